"""Structured output's cost in the scheduler: the unconstrained step, and one step's bitmask rows.

    python -m scheduler_proc.tools.bench_constraints --model ~/.cache/conveyor/models/SmolLM2-135M-Instruct

In process, no worker: (1) CPU time of schedule() + apply_result() per step with --num-seqs
unconstrained sequences decoding (compare it across commits: it must not move); (2) the first
constrained request's cost (llguidance import + token table + compile + matchers) and the
per-step Constraints.masks time for --constrained rows of one schema spread over a document.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from proto.config import EngineConfig
from proto.grammar import GrammarSpec
from proto.messages import AddRequest, StepResult
from proto.sampling import SamplingParams
from scheduler_proc.constraints import Constraints
from scheduler_proc.engine import SchedulerEngine
from scheduler_proc.request import Request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}, "role": {"enum": ["admin", "user"]},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "n", "ok", "role", "tags"], "additionalProperties": False}
DOCUMENT = '{"name": "conveyor belt", "n": 1234, "ok": true, "role": "admin", "tags": ["fast", "small", "json"]}'


def unconstrained_step_cpu_ms(num_seqs: int, steps: int) -> float:
    """Median CPU ms of schedule() + apply_result() over the steps where all num_seqs decode."""
    config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=1 << 16, vocab_size=49152,
                          eos_token_ids=(2,), max_model_len=4096)
    engine = SchedulerEngine(config, 8192, rng=random.Random(0))
    params = SamplingParams(max_tokens=steps + 2, temperature=0.8, ignore_eos=True, seed=1)
    rng = np.random.default_rng(0)
    for index in range(num_seqs):
        engine.add(AddRequest(f"r{index}", rng.integers(100, 1000, 64, dtype=np.int32), params, time.time()))
    times_ns = []
    while engine.has_unfinished_requests:
        start = time.process_time_ns()
        plan = engine.schedule()
        engine.apply_result(StepResult(plan.step_id, np.full(int(plan.sample_mask.sum()), 7, np.int32), ""))
        if plan.num_seqs == num_seqs and len(plan.input_ids) == num_seqs:
            times_ns.append(time.process_time_ns() - start)
    return float(np.median(times_ns)) / 1e6


def mask_step_ms(model_dir: str, vocab_size: int, num_rows: int, repeats: int = 20) -> dict[str, float]:
    import tokenizers

    token_ids = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(
        DOCUMENT, add_special_tokens=False).ids
    constraints = Constraints(EngineConfig(model=model_dir, vocab_size=vocab_size, eos_token_ids=(2,)))
    start = time.perf_counter()
    grammars, error = constraints.start(GrammarSpec.json_schema(SCHEMA), num_rows)
    first_ms = (time.perf_counter() - start) * 1e3
    assert not error, error
    requests = []
    for index, grammar in enumerate(grammars):  # spread over the document
        grammar.replay(token_ids[:index * len(token_ids) // num_rows])
        requests.append(Request(f"r{index}", np.array([1], np.int32), SamplingParams(), seed=0, grammar=grammar))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        constraints.masks(requests, list(range(num_rows)))
        times.append(time.perf_counter() - start)
    return {"first_constrained_request_ms": round(first_ms, 1), "masks_first_step_ms": round(times[0] * 1e3, 2),
            "masks_median_ms": round(float(np.median(times)) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory with tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--constrained", type=int, default=32)
    args = parser.parse_args()
    report = {"unconstrained_step_cpu_ms": [round(unconstrained_step_cpu_ms(args.num_seqs, args.steps), 3)
                                            for _ in range(3)],
              **mask_step_ms(args.model, args.vocab_size, args.constrained)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
