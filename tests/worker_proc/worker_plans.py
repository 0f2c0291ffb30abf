"""Test helper: builds StepPlans the way the scheduler does (block tables, sampling rows, history)."""

from __future__ import annotations

import numpy as np

from proto.config import EngineConfig
from proto.messages import StepPlan, StepResult
from proto.sampling import SamplingParams
from proto.sampling_columns import LogitBias, PenaltyHistory, SamplingColumns


class Seq:
    """One request as the scheduler sees it: its known tokens, KV blocks and sampling params
    (any SamplingParams field; greedy by default). logit_bias takes any value, -inf included,
    as the scheduler's min_tokens masks do."""

    def __init__(self, request_id: str, token_ids: list[int], num_prompt: int = -1, num_computed: int = 0,
                 block_ids: list[int] | None = None, logit_bias: list[tuple[int, float]] = (),
                 **sampling: object) -> None:
        self.request_id = request_id
        self.token_ids = token_ids  # prompt + generated so far
        self.num_prompt = len(token_ids) if num_prompt < 0 else num_prompt  # -1: every current token
        self.num_computed = num_computed
        self.block_ids = block_ids if block_ids is not None else []
        self.logit_bias = list(logit_bias)
        self.params = SamplingParams(**{"temperature": 0.0, "seed": 0, **sampling})


class BlockPool:
    """Hands out block ids in a scrambled order so tests catch any 'block i holds positions i*bs' bug."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free = list(np.random.default_rng(7).permutation(num_blocks))
        self.block_size = block_size

    def reserve(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.block_ids) * self.block_size < num_tokens:
            seq.block_ids.append(int(self.free.pop()))


def make_plan(seqs: list[Seq], num_scheduled: list[int], pool: BlockPool, step_id: int = 0) -> StepPlan:
    """Schedule num_scheduled[i] tokens of seqs[i] (from its num_computed on); a member samples when
    it reaches the end of its known tokens."""
    input_ids, cu_blocks, block_ids, sample_mask = [], [0], [], []
    cu_history, history, bias = [0], [], ([], [], [])
    for row, (seq, n) in enumerate(zip(seqs, num_scheduled)):
        end = seq.num_computed + n
        assert end <= len(seq.token_ids), "cannot schedule tokens that are not known yet"
        pool.reserve(seq, end)
        input_ids += seq.token_ids[seq.num_computed:end]
        block_ids += seq.block_ids
        cu_blocks.append(len(block_ids))
        sample_mask.append(end == len(seq.token_ids))
        if seq.params.has_penalties:
            history += seq.token_ids
        cu_history.append(len(history))
        for token_id, value in seq.logit_bias:
            bias[0].append(row)
            bias[1].append(token_id)
            bias[2].append(value)
    rows = np.array([SamplingColumns.param_row(s.params) for s in seqs], dtype=np.float64)
    sampling = SamplingColumns.from_rows(
        rows, np.array([s.params.seed for s in seqs], dtype=np.int64),
        LogitBias(np.array(bias[0], dtype=np.int32), np.array(bias[1], dtype=np.int32),
                  np.array(bias[2], dtype=np.float32)),
        PenaltyHistory(np.array(cu_history, dtype=np.int32), np.array(history, dtype=np.int32),
                       np.array([s.num_prompt if s.params.has_penalties else 0 for s in seqs], dtype=np.int32)))
    return StepPlan(
        step_id=step_id, request_ids=[s.request_id for s in seqs],
        input_ids=np.array(input_ids, dtype=np.int32),
        num_computed_tokens=np.array([s.num_computed for s in seqs], dtype=np.int32),
        num_scheduled_tokens=np.array(num_scheduled, dtype=np.int32),
        cu_block_ids=np.array(cu_blocks, dtype=np.int32), block_ids=np.array(block_ids, dtype=np.int32),
        sample_mask=np.array(sample_mask, dtype=np.bool_), sampling=sampling)


def advance(seqs: list[Seq], num_scheduled: list[int], plan: StepPlan, result: StepResult) -> None:
    """Apply a step's outcome: computed tokens move on and sampling members get their new token."""
    for seq, n in zip(seqs, num_scheduled):
        seq.num_computed += n
    sampled = result.sampled_token_ids.tolist()
    for seq, token_id in zip([s for s, m in zip(seqs, plan.sample_mask) if m], sampled):
        seq.token_ids.append(int(token_id))


def tiny_engine_config(model_dir: object, **changes: object) -> EngineConfig:
    """A small fp32 config for the tiny model: few KV blocks, two threads."""
    base = dict(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=64, num_threads=2)
    base.update(changes)
    return EngineConfig(**base)
