"""The worker applies the plan's grammar rows: a constrained row samples only allowed tokens, and
its logprobs are of the masked distribution; other rows are untouched; a mask of the wrong width
fails the step, not the worker."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from proto.config import EngineConfig
from proto.messages import GrammarMasks, StepPlan
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config
from worker_proc.grammar_mask import apply_plan_masks_
from worker_proc.null_runner import NullModelRunner
from worker_proc.runner import ModelRunner

VOCAB = 512  # the tiny model's


def _masks(plan: StepPlan, allowed: dict[int, list[int]], vocab: int = VOCAB) -> StepPlan:
    """The plan with member row -> allowed token ids as its grammar rows."""
    words = -(-vocab // 32)
    bits = np.zeros((len(allowed), words * 32), dtype=np.uint8)
    for index, token_ids in enumerate(allowed.values()):
        bits[index, token_ids] = 1
    bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # int32 [k, words]
    return dataclasses.replace(plan, grammar=GrammarMasks(np.array(list(allowed), dtype=np.int32), words,
                                                          bitmask.reshape(-1)))


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(tiny_engine_config(tiny_model_dir, num_kv_blocks=64), rank=0, show_progress=False)


def test_constrained_rows_sample_allowed_tokens_with_masked_logprobs_and_others_are_untouched(
        runner: ModelRunner) -> None:
    seqs = [Seq(name, [5, 17, 42, 9, 100 + i], logprobs=5, temperature=t)
            for i, (name, t) in enumerate([("free", 0.0), ("json", 0.0), ("hot", 1.0)])]
    plan = make_plan(seqs, [5, 5, 5], BlockPool(64, 4))
    free = runner.execute(plan)
    seqs = [Seq(s.request_id, s.token_ids, block_ids=[], logprobs=5, temperature=s.params.temperature)
            for s in seqs]
    constrained = runner.execute(_masks(make_plan(seqs, [5, 5, 5], BlockPool(64, 4), step_id=1),
                                        {1: [300, 301], 2: [7]}))
    tokens = constrained.sampled_token_ids.tolist()
    assert tokens[0] == free.sampled_token_ids[0] and tokens[1] in (300, 301) and tokens[2] == 7
    entries = constrained.logprobs
    cu = entries.cu_top.tolist()
    for entry, row in enumerate(entries.rows.tolist()):
        top = entries.top_token_ids[cu[entry]:cu[entry + 1]].tolist()
        if row == 1:
            assert sorted(top) == [300, 301] and np.isfinite(entries.top_logprobs[cu[entry]:cu[entry + 1]]).all()
            assert np.isclose(np.exp(entries.top_logprobs[cu[entry]:cu[entry + 1]]).sum(), 1.0, atol=1e-5)
        if row == 2:
            assert top == [7] and abs(float(entries.logprobs[entry])) < 1e-6
        if row == 0:
            assert len(top) == 5


def test_masks_of_another_width_than_the_vocab_fail_the_step(runner: ModelRunner) -> None:
    plan = _masks(make_plan([Seq("a", [5, 6, 7])], [3], BlockPool(64, 4)), {0: [1]}, vocab=VOCAB + 64)
    result = runner.execute(plan)
    assert "needs 16" in result.error and len(result.sampled_token_ids) == 0


def test_apply_plan_masks_touches_only_the_constrained_sampling_rows() -> None:
    plan = make_plan([Seq("a", [1, 2]), Seq("b", [3, 4], num_computed=0), Seq("c", [5, 6])], [1, 2, 2],
                     BlockPool(16, 4))  # "a" is a chunk that does not sample
    plan = _masks(plan, {2: [0, 511]})
    logits = torch.zeros(2, VOCAB)  # the sampling rows: members 1 and 2
    assert apply_plan_masks_(logits, plan, np.flatnonzero(plan.sample_mask)) == ""
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 511]


def test_the_null_model_samples_an_allowed_token_on_a_constrained_row() -> None:
    runner = NullModelRunner(EngineConfig(null_model=True, vocab_size=VOCAB, num_kv_blocks=8), rank=0)
    plan = _masks(make_plan([Seq("a", [1, 2]), Seq("b", [3, 4])], [2, 2], BlockPool(8, 4)), {1: [33, 480]})
    tokens = runner.execute(plan).sampled_token_ids.tolist()
    assert tokens[1] in (33, 480)
