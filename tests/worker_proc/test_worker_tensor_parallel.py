"""Tensor parallelism over gloo on the CPU: two ranks give the single-rank logits, tokens and
logprobs, also when the model has fewer KV heads than ranks (replicated)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_model import build_tiny_model
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from proto.config import EngineConfig
from proto.messages import StepPlan, StepResult
from worker_proc.devices import cpu_share
from worker_proc.runner import ModelRunner

TIMEOUT_S = 120


def mixed_plans() -> list[StepPlan]:
    """A prefill step, then a step mixing a decode with a continuing chunk (shared by all ranks)."""
    pool = BlockPool(64, block_size=4)
    seqs = [Seq("a", [5, 9, 13, 17, 21, 25, 29]), Seq("b", list(range(40, 60)))]
    first = make_plan(seqs, [7, 8], pool, step_id=0)
    seqs[0].num_computed, seqs[1].num_computed = 7, 8
    seqs[0].token_ids.append(33)
    return [first, make_plan(seqs, [1, 12], pool, step_id=1)]


def logprob_plan() -> StepPlan:
    """The first plan again (same KV: harmless), now asking for sampled and prompt logprobs."""
    plan = mixed_plans()[0]
    sampling = dataclasses.replace(plan.sampling, logprobs=np.array([2, 2], dtype=np.int32),
                                   num_prompt_logprobs=np.array([3, -1], dtype=np.int32),
                                   next_prompt_token_ids=np.array([-1, -1], dtype=np.int32))
    return dataclasses.replace(plan, sampling=sampling)


def mid_prompt_plan() -> StepPlan:
    """A chunk in mid-prompt alone: no row samples, so every rank skips the last layer's
    projection and MLP, and its all-reduce, alike. (Its blocks are the first plan's, which the
    logprob plan then computes afresh.)"""
    return make_plan([Seq("c", list(range(70, 90)))], [8], BlockPool(64, block_size=4), step_id=0)


def run_rank(config: EngineConfig, rank: int, results: mp.Queue) -> None:
    runner = ModelRunner(config, rank, show_progress=False)
    # numpy, not torch: a torch tensor crosses the queue as a shared fd that dies with this process
    logits = [runner.logits_for_all_tokens(plan).numpy() for plan in mixed_plans()]
    quiet = runner.execute(mid_prompt_plan())
    assert quiet.error == "" and len(quiet.sampled_token_ids) == 0, quiet
    results.put((rank, logits, runner.execute(logprob_plan())))


def run_two_ranks(config: EngineConfig) -> dict[int, tuple[list[np.ndarray], StepResult]]:
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=run_rank, args=(config, rank, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        return {rank: (logits, result) for rank, logits, result in
                (results.get(timeout=TIMEOUT_S) for _ in procs)}
    finally:
        for proc in procs:
            proc.join(timeout=TIMEOUT_S)
            proc.kill()


def assert_ranks_match_single(model_dir: Path, runtime_dir: Path) -> None:
    single = ModelRunner(tiny_engine_config(model_dir), rank=0, show_progress=False)
    expected = [single.logits_for_all_tokens(plan) for plan in mixed_plans()]
    want = single.execute(logprob_plan())
    config = tiny_engine_config(model_dir, tensor_parallel_size=2, num_threads=1,
                                runtime_dir=str(runtime_dir))
    outputs = run_two_ranks(config)
    for rank in range(2):
        logits, result = outputs[rank]
        for got, reference in zip(logits, expected):
            torch.testing.assert_close(torch.from_numpy(got), reference, atol=1e-4, rtol=0)
        assert result.rank == rank and result.error == ""
    got = outputs[0][1]  # only rank 0 samples and reports logprobs; the others acknowledge
    assert got.sampled_token_ids.tolist() == want.sampled_token_ids.tolist()
    for name in ("rows", "positions", "token_ids", "cu_top", "top_token_ids"):
        assert getattr(got.logprobs, name).tolist() == getattr(want.logprobs, name).tolist(), name
    np.testing.assert_allclose(got.logprobs.logprobs, want.logprobs.logprobs, atol=1e-4)
    np.testing.assert_allclose(got.logprobs.top_logprobs, want.logprobs.top_logprobs, atol=1e-4)
    assert len(got.logprobs.rows) == 6 + 1  # prompt positions 1..6 of "a", then its sampled token
    other = outputs[1][1]
    assert len(other.sampled_token_ids) == 0 and len(other.logprobs.rows) == 0


@pytest.mark.cpu_workers  # both ranks of this test would take the same GPU
def test_two_ranks_reproduce_the_single_rank_forward(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert_ranks_match_single(tiny_model_dir, tmp_path)


@pytest.mark.cpu_workers  # both ranks of this test would take the same GPU
def test_kv_heads_are_replicated_when_fewer_than_ranks(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "one-kv-head", num_key_value_heads=1)
    assert_ranks_match_single(model_dir, tmp_path)


@pytest.mark.parametrize("cores, workers, shares", [
    ([0, 1], 2, [[0], [1]]),
    ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
    ([4, 5, 6, 7], 4, [[4], [5], [6], [7]]),
    ([0], 2, [[0], [0]]),  # fewer cores than workers: they share
])
def test_cpu_workers_split_the_allowed_cores_evenly(cores: list[int], workers: int,
                                                     shares: list[list[int]]) -> None:
    assert [cpu_share(cores, rank, workers) for rank in range(workers)] == shares


@pytest.mark.parametrize("cores, tp, node_rank, expected", [
    ([0, 1], 1, 0, [0, 1]),  # too few cores: sharing them costs less than giving one up
    ([0, 1, 2, 3], 1, 0, [0, 1, 2, 3]),
    ([0, 1, 2, 3, 4], 1, 0, [0, 1, 2, 3]),  # from 5 cores one is left to frontend + scheduler
    ([0, 1, 2, 3, 4], 5, 0, [0, 1, 2, 3, 4]),  # no core to spare: the workers take them all
    ([0, 1, 2, 3, 4], 1, 1, [0, 1, 2, 3, 4]),  # a worker-only node keeps every core
    ([0], 1, 0, [0]),
])
def test_node_zero_leaves_a_core_to_the_frontend_when_it_pays(
        monkeypatch: pytest.MonkeyPatch, cores: list[int], tp: int, node_rank: int,
        expected: list[int]) -> None:
    from proto.config import EngineConfig
    from worker_proc import devices

    monkeypatch.setattr(devices, "allowed_cores", lambda: cores)
    nnodes = 2 if node_rank else 1
    config = EngineConfig(tensor_parallel_size=tp * nnodes, nnodes=nnodes, node_rank=node_rank,
                          master_addr="127.0.0.1" if nnodes > 1 else "", insecure_transport=nnodes > 1)
    assert devices.worker_cores(config) == expected
