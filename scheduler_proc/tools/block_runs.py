"""How a trace's KV blocks lie in memory: runs of consecutive block ids in the decodes' tables.

    python -m scheduler_proc.tools.block_runs --trace heavy.jsonl --num-kv-blocks 1456 \
        --save-tables tables.npz
    python -m worker_proc.tools.bench_attention --decode-tables tables.npz

The trace runs through the real SchedulerEngine at the server's defaults (seats, token budget,
block size, prefix caching) with as many KV blocks as a worker reports (1456: the default model in
fp32 on 1 GiB), every plan answered at once with one synthetic token per sampling member and every
request generating exactly its output_len (`ignore_eos`). That reproduces the server's block
tables: which blocks the scheduler hands out depends on the order of its steps, not their speed.

Each decode of each step reads its context's blocks in table order; the attention kernel streams
a run of consecutive ids as one run of memory. Printed: the mean length of the run each block
read belongs to, the share of reads from blocks standing alone, and the prefix cache's hit rate
(which block is evicted when decides it). --save-tables keeps the decode
members' tables and contexts of a few steps for bench_attention to time the kernel on.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np

from proto.config import EngineConfig
from proto.messages import AddRequest, StepPlan, StepResult
from proto.sampling import SamplingParams
from proto.trace import TraceEntry, load_trace
from scheduler_proc.block_manager import blocks_for_tokens
from scheduler_proc.engine import SchedulerEngine

_VOCAB_SIZE = 49152  # the default model's; the trace's token ids must be below it
_SAVED_STEP_FRACTIONS = (0.25, 0.5, 0.75)  # of the run's steps, whose decode tables are saved


class RunStats:
    """Block reads of decode members, by the length of the run of consecutive ids they lie in."""

    def __init__(self) -> None:
        self.num_reads = 0
        self.run_weighted_reads = 0  # sum over reads of the length of the read block's run
        self.lone_reads = 0  # reads of blocks whose neighbours in the table are not id +- 1
        self.prefix_hit_rate = 0.0  # of the prompt tokens looked up in the prefix cache, found

    def add(self, table: np.ndarray) -> None:
        breaks = np.flatnonzero(np.diff(table.astype(np.int64)) != 1)
        lengths = np.diff(np.concatenate([[0], breaks + 1, [len(table)]]))  # int64 [num_runs]
        self.num_reads += len(table)
        self.run_weighted_reads += int((lengths * lengths).sum())
        self.lone_reads += int((lengths == 1).sum())

    def summary(self) -> str:
        reads = max(self.num_reads, 1)
        return (f"{self.num_reads} block reads by decodes; mean run {self.run_weighted_reads / reads:.2f} "
                f"blocks; {100 * self.lone_reads / reads:.1f}% of reads from a block standing alone")


def decode_tables(plan: StepPlan, block_size: int) -> tuple[list[np.ndarray], list[int]]:
    """Each decode member's table, cut to its context, and the context (positions it attends)."""
    tables, contexts = [], []
    for member in np.flatnonzero(plan.num_scheduled_tokens == 1).tolist():
        context = int(plan.num_computed_tokens[member]) + 1
        table = plan.block_ids[plan.cu_block_ids[member]:plan.cu_block_ids[member + 1]]
        tables.append(np.array(table[:blocks_for_tokens(context, block_size)], dtype=np.int32))
        contexts.append(context)
    return tables, contexts


def serve_config(entries: list[TraceEntry], num_kv_blocks: int) -> EngineConfig:
    """The server's defaults, with room for the trace's longest request and all its requests waiting."""
    return EngineConfig(model="block-runs", num_kv_blocks=num_kv_blocks,
                        max_model_len=max(len(e.prompt_token_ids) + e.output_len for e in entries) + 1,
                        max_num_waiting=len(entries), vocab_size=_VOCAB_SIZE, eos_token_ids=())


def run(entries: list[TraceEntry], config: EngineConfig) -> tuple[RunStats, list[tuple[list[np.ndarray], list[int]]]]:
    """Replay the trace; the stats and every step's decode tables (as decode_tables)."""
    engine = SchedulerEngine(config, config.num_kv_blocks, rng=random.Random(0))
    for index, entry in enumerate(entries):
        params = SamplingParams(max_tokens=entry.output_len, temperature=0.0, ignore_eos=True)
        engine.add(AddRequest(f"r{index:05d}", np.asarray(entry.prompt_token_ids, dtype=np.int32), params, 0.0))
    stats, steps = RunStats(), []
    rng = np.random.default_rng(0)  # sampled ids only feed the prefix cache's keys
    while engine.has_unfinished_requests:
        plan = engine.schedule()
        if plan is None:
            raise RuntimeError("the engine scheduled nothing with requests unfinished")
        tables, contexts = decode_tables(plan, config.block_size)
        for table in tables:
            stats.add(table)
        steps.append((tables, contexts))
        num_sampled = int(plan.sample_mask.sum())
        engine.apply_result(StepResult(plan.step_id, rng.integers(100, _VOCAB_SIZE, num_sampled, dtype=np.int32), ""))
    final = engine.stats()
    stats.prefix_hit_rate = final.prefix_cache_hits_total / max(final.prefix_cache_queries_total, 1)
    return stats, steps


def save_tables(path: Path, steps: list[tuple[list[np.ndarray], list[int]]], num_kv_blocks: int,
                block_size: int) -> list[int]:
    """Write the decode tables of the steps at _SAVED_STEP_FRACTIONS of the run; their indices."""
    chosen = sorted({min(len(steps) - 1, int(f * len(steps))) for f in _SAVED_STEP_FRACTIONS})
    arrays: dict[str, np.ndarray] = {"num_kv_blocks": np.array(num_kv_blocks), "block_size": np.array(block_size)}
    for index in chosen:
        tables, contexts = steps[index]
        width = max((len(t) for t in tables), default=0)
        padded = np.zeros((len(tables), width), dtype=np.int32)  # int32 [members, blocks]
        for row, table in enumerate(tables):
            padded[row, :len(table)] = table
        arrays[f"step{index}_tables"] = padded
        arrays[f"step{index}_contexts"] = np.asarray(contexts, dtype=np.int32)
    np.savez(path, **arrays)
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler_proc.tools.block_runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True, help="a JSONL trace (`conveyor bench --save-trace`)")
    parser.add_argument("--num-kv-blocks", type=int, required=True,
                        help="KV blocks, as the server logs them at start-up")
    parser.add_argument("--save-tables", type=Path, help="an .npz for bench_attention --decode-tables")
    args = parser.parse_args(argv)
    try:
        entries = load_trace(args.trace)
        if not entries:
            raise ValueError("the trace holds no requests")
        if args.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1, got {args.num_kv_blocks}")
        config = serve_config(entries, args.num_kv_blocks)
        stats, steps = run(entries, config)
    except (ValueError, OSError) as exc:
        print(f"block_runs: {exc}", file=sys.stderr)
        return 2
    print(f"{len(steps)} steps; {stats.summary()}; prefix cache: {100 * stats.prefix_hit_rate:.2f}% "
          "of prompt tokens found")
    if args.save_tables:
        chosen = save_tables(args.save_tables, steps, config.num_kv_blocks, config.block_size)
        print(f"decode tables of steps {chosen} saved to {args.save_tables}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
