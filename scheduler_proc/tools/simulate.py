"""The slot simulator: the real SchedulerEngine, static vs continuous, on the same trace.

    conveyor simulate --num-prompts 64 --num-slots 8 [--output-dist heavy|uniform]
    python -m scheduler_proc.tools.simulate --trace TRACE.jsonl --num-slots 8 [--step-ms 50]

`conveyor simulate` draws the workload with deploy's trace generator and hands it over as a
trace file (the format of proto.trace), which this program reads: it draws nothing itself.
No model and no worker: every plan the engine makes is answered at once with a synthetic
StepResult (one ordinary token per sampling member), so a "step" is one schedule/apply round of
the real policy code, and a request arriving at `arrival_s` joins the waiting queue at step
floor(arrival_s / step duration). Each request asks for `max_tokens` = its `output_len` with
`ignore_eos`, so it generates exactly that many tokens. Per step the simulator records which seat
holds which request and whether the seat is generating, finished-but-held (a static batch's
padding) or idle, then prints the comparison and draws one PNG timeline per policy.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from proto.config import EngineConfig
from proto.messages import AddRequest, StepPlan, StepResult
from proto.sampling import SamplingParams
from proto.trace import TraceEntry, load_trace
from scheduler_proc.block_manager import blocks_for_tokens
from scheduler_proc.engine import SchedulerEngine

IDLE, GENERATING, HELD = 0, 1, 2  # seat states in a timeline
POLICIES = ("static", "continuous")
DEFAULT_STEP_MS = 50.0
MAX_TOTAL_TOKENS = 200_000  # about 15 s at worst (one slot): long, but never an apparent hang
MAX_ARRIVAL_STEPS = 100_000
MAX_TIMELINE_CELLS = 50_000_000  # slots x steps bound; keeps the timelines within ~250 MB
_SAMPLED_TOKEN_ID = 7  # any ordinary token: requests ignore EOS and stop at max_tokens
_VOCAB_SIZE = 1 << 16


@dataclass(frozen=True)
class Workload:
    """A trace in steps. Request i is the i-th to arrive (ties keep the trace's order)."""

    arrival_steps: list[int]  # per request, non-decreasing
    lengths: list[int]  # per request: tokens it generates
    prompts: list[np.ndarray]  # per request: int32 [prompt_len] token ids


def workload_from_trace(entries: list[TraceEntry], step_ms: float = DEFAULT_STEP_MS) -> Workload:
    """The trace's requests in arrival order, their arrivals counted in steps of `step_ms`.
    Raises ValueError for a step duration or a workload the simulator cannot run."""
    if not (math.isfinite(step_ms) and step_ms > 0):
        raise ValueError(f"--step-ms must be a finite number > 0, got {step_ms}")
    if not entries:
        raise ValueError("the trace holds no requests")
    ordered = sorted(entries, key=lambda entry: entry.arrival_s)
    # The epsilon keeps an arrival exactly on a step boundary (0.15 s at 50 ms) on that step.
    arrivals = [math.floor(entry.arrival_s * 1000.0 / step_ms + 1e-9) for entry in ordered]
    lengths = [entry.output_len for entry in ordered]
    if arrivals[-1] >= MAX_ARRIVAL_STEPS:
        raise ValueError(f"the last request arrives at step {arrivals[-1]}; the simulator takes at most "
                         f"{MAX_ARRIVAL_STEPS} steps of arrivals (a higher --request-rate or longer --step-ms)")
    if sum(lengths) > MAX_TOTAL_TOKENS:
        raise ValueError(f"the workload generates {sum(lengths)} tokens; the simulator takes at most "
                         f"{MAX_TOTAL_TOKENS} (fewer --num-prompts or shorter outputs)")
    prompts = [np.asarray(entry.prompt_token_ids, dtype=np.int32) for entry in ordered]
    return Workload(arrivals, lengths, prompts)


@dataclass(frozen=True)
class SimResult:
    """One policy's run. timeline[seat, step] is IDLE, GENERATING or HELD; occupants[seat, step]
    is the index of the request in that seat, -1 when idle."""

    policy: str
    timeline: np.ndarray  # int8 [num_slots, num_steps]
    occupants: np.ndarray  # int32 [num_slots, num_steps]
    arrival_steps: list[int]
    finish_steps: list[int]  # per request: the step that produced its last token

    @property
    def num_slots(self) -> int:
        return self.timeline.shape[0]

    @property
    def num_steps(self) -> int:
        return self.timeline.shape[1]

    def completed_within(self, num_steps: int) -> int:
        return sum(step < num_steps for step in self.finish_steps)

    @property
    def slot_utilisation(self) -> float:
        return float((self.timeline == GENERATING).mean())

    @property
    def padding_waste(self) -> float:
        return float((self.timeline == HELD).mean())

    @property
    def mean_latency_steps(self) -> float:
        """Steps from arrival through the step of the last token, averaged over requests."""
        return float(np.mean([f - a + 1 for a, f in zip(self.arrival_steps, self.finish_steps)]))


class SeatMap:
    """Stable seat numbers for plan members: a member keeps its seat while it appears in
    consecutive plans; a newcomer takes the lowest free seat."""

    def __init__(self, num_slots: int) -> None:
        self.occupants: list[str | None] = [None] * num_slots

    def place(self, request_ids: list[str]) -> list[int]:
        present = set(request_ids)
        self.occupants = [rid if rid in present else None for rid in self.occupants]
        seat_of = {rid: seat for seat, rid in enumerate(self.occupants) if rid is not None}
        for rid in request_ids:
            if rid not in seat_of:
                assert None in self.occupants, f"a plan holds more members than {len(self.occupants)} seats"
                seat = self.occupants.index(None)
                self.occupants[seat] = rid
                seat_of[rid] = seat
        return [seat_of[rid] for rid in request_ids]


def simulation_config(workload: Workload, num_slots: int, policy: str) -> EngineConfig:
    """KV blocks and token budget large enough that only the seat limit and the policy matter:
    every prompt is computed in one step, and no two requests share cached blocks."""
    max_prompt_len = max(len(prompt) for prompt in workload.prompts)
    max_len = max(len(prompt) + length for prompt, length in zip(workload.prompts, workload.lengths))
    block_size = 16
    blocks_per_request = blocks_for_tokens(max_len, block_size) + 1
    return EngineConfig(
        model="simulator", scheduling=policy, max_num_seqs=num_slots, block_size=block_size,
        num_kv_blocks=(num_slots + 1) * blocks_per_request,
        max_num_batched_tokens=num_slots * (max_prompt_len + 1), max_model_len=max_len,
        max_num_waiting=len(workload.lengths), enable_prefix_caching=False,
        vocab_size=max(_VOCAB_SIZE, max(int(prompt.max()) for prompt in workload.prompts) + 1),
        eos_token_ids=())


def max_num_steps(workload: Workload) -> int:
    """No policy needs more steps: the last arrival, then every token one after another."""
    return workload.arrival_steps[-1] + sum(workload.lengths)


def check_slots(workload: Workload, num_slots: int) -> None:
    """Refuse a slot count that cannot run, or whose timeline could not fit in memory."""
    if num_slots < 1:
        raise ValueError(f"--num-slots must be >= 1, got {num_slots}")
    max_steps = max_num_steps(workload)
    if num_slots * max_steps > MAX_TIMELINE_CELLS:
        raise ValueError(f"{num_slots} slots x up to {max_steps} steps exceeds the simulator's "
                         f"{MAX_TIMELINE_CELLS} timeline cells (fewer --num-slots or a smaller workload)")


def simulate(workload: Workload, num_slots: int, policy: str) -> SimResult:
    """Run the workload through the real engine with `num_slots` seats under `policy`."""
    check_slots(workload, num_slots)
    config = simulation_config(workload, num_slots, policy)
    engine = SchedulerEngine(config, config.num_kv_blocks, rng=random.Random(0))
    seats = SeatMap(num_slots)
    columns: list[tuple[np.ndarray, np.ndarray]] = []
    finish_steps: dict[str, int] = {}
    next_request = 0
    step = 0
    step_limit = max_num_steps(workload)  # a bug in a policy must fail here, never spin forever
    while next_request < len(workload.lengths) or engine.has_unfinished_requests:
        while next_request < len(workload.lengths) and workload.arrival_steps[next_request] <= step:
            _add(engine, workload, next_request)
            next_request += 1
        plan = engine.schedule()
        column = np.full(num_slots, IDLE, dtype=np.int8)  # int8 [num_slots]
        occupants = np.full(num_slots, -1, dtype=np.int32)  # int32 [num_slots]
        if plan is not None:
            _record(engine, plan, seats, column, occupants)
            _answer(engine, plan, step, finish_steps)
        else:
            seats.place([])
        columns.append((column, occupants))
        step += 1
        assert step <= step_limit, f"{policy} did not finish in {step} steps"
    ordered = [finish_steps[_request_id(i)] for i in range(len(workload.lengths))]
    timeline = np.stack([c for c, _ in columns], axis=1)  # int8 [num_slots, num_steps]
    occupants = np.stack([o for _, o in columns], axis=1)  # int32 [num_slots, num_steps]
    return SimResult(policy, timeline, occupants, list(workload.arrival_steps), ordered)


def _request_id(index: int) -> str:
    return f"r{index:05d}"


def _add(engine: SchedulerEngine, workload: Workload, index: int) -> None:
    params = SamplingParams(max_tokens=workload.lengths[index], temperature=0.0, ignore_eos=True)
    engine.add(AddRequest(_request_id(index), workload.prompts[index], params, 0.0))


def _record(engine: SchedulerEngine, plan: StepPlan, seats: SeatMap, column: np.ndarray,
            occupants: np.ndarray) -> None:
    """A member whose request the engine has already finished holds its seat as padding."""
    for request_id, seat in zip(plan.request_ids, seats.place(list(plan.request_ids))):
        column[seat] = GENERATING if engine.get_request(request_id) is not None else HELD
        occupants[seat] = int(request_id[1:])


def _answer(engine: SchedulerEngine, plan: StepPlan, step: int, finish_steps: dict[str, int]) -> None:
    num_sampled = int(plan.sample_mask.sum())
    result = StepResult(plan.step_id, np.full(num_sampled, _SAMPLED_TOKEN_ID, dtype=np.int32), "")
    outputs = engine.apply_result(result)
    for request_id, reason, error in zip(outputs.request_ids, outputs.finish_reasons, outputs.error_messages):
        if reason and reason != "length":
            raise RuntimeError(f"{request_id} finished with {reason!r} ({error}); the simulation is broken")
        if reason:
            finish_steps[request_id] = step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scheduler_proc.tools.simulate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True,
                        help="the workload, a JSONL trace (`conveyor simulate` writes one)")
    parser.add_argument("--num-slots", type=int, default=8, help="seats in the batch (max_num_seqs)")
    parser.add_argument("--step-ms", type=float, default=DEFAULT_STEP_MS,
                        help="simulated duration of one step, to count the trace's arrivals in steps")
    parser.add_argument("--within-steps", type=int, default=0,
                        help="K of completed-within-K-steps (0 = the faster policy's total steps)")
    parser.add_argument("--out-dir", type=Path, default=Path("."), help="where the PNG timelines go")
    parser.add_argument("--no-plot", action="store_true", help="print the comparison only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.within_steps < 0:
            raise ValueError(f"--within-steps must be >= 0, got {args.within_steps}")
        workload = workload_from_trace(load_trace(args.trace), args.step_ms)
        check_slots(workload, args.num_slots)
    except (ValueError, OSError) as exc:
        print(f"conveyor simulate: {exc}", file=sys.stderr)
        return 2
    results = [simulate(workload, args.num_slots, policy) for policy in POLICIES]
    within_steps = args.within_steps or min(r.num_steps for r in results)
    from scheduler_proc.tools.simulate_report import report, write_timeline

    print(report(workload, args.step_ms, args.num_slots, results, within_steps))
    if not args.no_plot:
        num_steps_axis = max(r.num_steps for r in results)  # one x scale, so lengths compare
        for result in results:
            path = write_timeline(result, args.out_dir / f"simulate-{result.policy}.png", within_steps,
                                  num_steps_axis)
            print(f"{result.policy} timeline: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
