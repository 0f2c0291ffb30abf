"""The null-model runner, and what a worker answers for plans it cannot execute."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from deploy.model_info import read_model_info, resolve_model_facts
from proto.config import EngineConfig
from worker_proc.loop import execute_step
from worker_proc.null_runner import NullModelRunner
from worker_proc.runner import ModelRunner, create_runner


def decode_plan(num_seqs: int, context: int, seed_offset: int = 0) -> tuple[list[Seq], object]:
    seqs = [Seq(f"r{i}", [1] * context, num_computed=context - 1, seed=i + seed_offset)
            for i in range(num_seqs)]
    return seqs, make_plan(seqs, [1] * num_seqs, BlockPool(num_seqs * 4, block_size=16))


def test_null_runner_never_returns_an_eos_id() -> None:
    runner = NullModelRunner(EngineConfig(null_model=True, vocab_size=4, eos_token_ids=(0, 1, 2),
                                          num_kv_blocks=8), rank=0)
    for context in range(1, 40):
        _, plan = decode_plan(5, context)
        assert set(runner.execute(plan).sampled_token_ids.tolist()) == {3}


def test_null_runner_is_deterministic_and_ignores_batch_mates() -> None:
    config = EngineConfig(null_model=True, vocab_size=49152, eos_token_ids=(2,), num_kv_blocks=8)
    runner = NullModelRunner(config, rank=0)
    _, plan = decode_plan(6, context=9)
    tokens = runner.execute(plan).sampled_token_ids
    assert tokens.dtype == np.int32 and tokens.shape == (6,)
    assert np.array_equal(tokens, NullModelRunner(config, rank=0).execute(plan).sampled_token_ids)
    _, alone = decode_plan(1, context=9, seed_offset=3)
    assert runner.execute(alone).sampled_token_ids[0] == tokens[3]
    assert len(set(tokens.tolist())) > 1
    assert not np.isin(tokens, [2]).any()


def test_null_runner_reports_blocks_without_allocating_or_loading(tiny_model_dir: Path) -> None:
    given = create_runner(EngineConfig(null_model=True, vocab_size=10, num_kv_blocks=77), 0)
    assert given.num_kv_blocks == 77
    config = EngineConfig(model=str(tiny_model_dir), null_model=True, kv_cache_memory_bytes=1 << 20,
                          dtype="float32")
    derived = create_runner(resolve_model_facts(config, read_model_info(tiny_model_dir)), 0)
    assert derived.vocab_size == 512  # the model's, as the supervisor resolved it: no weights touched
    assert derived.num_kv_blocks == (1 << 20) // (2 * 2 * 16 * 2 * 16 * 4)


def test_null_runner_without_a_vocab_refuses_to_start() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        NullModelRunner(EngineConfig(null_model=True), rank=0)


def test_a_plan_with_too_few_blocks_gives_an_error_result_not_a_crash(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    seq = Seq("short", list(range(3, 12)))
    plan = make_plan([seq], [9], BlockPool(64, block_size=4))
    broken = make_plan([Seq("short", list(range(3, 12)), block_ids=seq.block_ids[:1])], [9],
                       BlockPool(0, block_size=16))  # 16-token pool lets the plan through
    result = execute_step(runner, broken)
    assert result.step_id == broken.step_id and len(result.sampled_token_ids) == 0
    assert "'short' has 1 KV blocks of 4 tokens for a context of 9 tokens" in result.error
    ok = execute_step(runner, plan)  # the runner is still usable after a failed step
    assert ok.error == "" and ok.sampled_token_ids.shape == (1,)


def test_members_that_do_not_reach_their_end_sample_nothing(tiny_model_dir: Path) -> None:
    runner = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    pool = BlockPool(64, block_size=4)
    seqs = [Seq("chunk", list(range(3, 20))), Seq("whole", [7, 8, 9])]
    tokens = runner.execute(make_plan(seqs, [5, 3], pool)).sampled_token_ids
    assert tokens.shape == (1,)  # only "whole" reached the end of its known tokens
