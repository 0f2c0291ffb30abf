"""Tensor parallelism over gloo on the CPU: two ranks give the single-rank logits and tokens."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import torch
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from proto.config import EngineConfig
from worker_proc.runner import ModelRunner

TIMEOUT_S = 120


def mixed_plans() -> list:
    """A prefill step, then a step mixing a decode with a continuing chunk (shared by all ranks)."""
    pool = BlockPool(64, block_size=4)
    seqs = [Seq("a", [5, 9, 13, 17, 21, 25, 29]), Seq("b", list(range(40, 60)))]
    first = make_plan(seqs, [7, 8], pool, step_id=0)
    seqs[0].num_computed, seqs[1].num_computed = 7, 8
    seqs[0].token_ids.append(33)
    return [first, make_plan(seqs, [1, 12], pool, step_id=1)]


def run_rank(config: EngineConfig, rank: int, results: mp.Queue) -> None:
    runner = ModelRunner(config, rank, show_progress=False)
    # numpy, not torch: a torch tensor crosses the queue as a shared fd that dies with this process
    logits = [runner.logits_for_all_tokens(plan).numpy() for plan in mixed_plans()]
    tokens = runner.execute(mixed_plans()[0])  # same KV again: harmless, shows sampling agrees
    results.put((rank, logits, tokens))


def test_two_ranks_reproduce_the_single_rank_forward(tiny_model_dir: Path, tmp_path: Path) -> None:
    single = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    expected = [single.logits_for_all_tokens(plan) for plan in mixed_plans()]
    expected_tokens = single.execute(mixed_plans()[0])

    config = tiny_engine_config(tiny_model_dir, tensor_parallel_size=2, num_threads=1,
                                runtime_dir=str(tmp_path))
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=run_rank, args=(config, rank, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        outputs = {rank: (logits, tokens) for rank, logits, tokens in
                   (results.get(timeout=TIMEOUT_S) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(timeout=TIMEOUT_S)
            proc.kill()
    for rank in range(2):
        logits, tokens = outputs[rank]
        for got, want in zip(logits, expected):
            torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-4, rtol=0)
        assert tokens.tolist() == expected_tokens.tolist()
