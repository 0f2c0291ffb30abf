"""Turn a ScheduledBatch into one proto StepPlan: O(batch) numpy, no per-token Python loops."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from proto.messages import StepPlan
from proto.sampling_columns import LogitBias, PenaltyHistory, SamplingColumns
from scheduler_proc.constraints import NO_MASKS, Constraints
from scheduler_proc.plan_constants import HAS_BIAS, HAS_PENALTIES, NUM_PARAMS, PADDING_ROW, PlanConstants
from scheduler_proc.request import Request
from scheduler_proc.scheduled_batch import ScheduledBatch
from scheduler_proc.stop import active_bias

_EMPTY_INT32 = np.empty(0, dtype=np.int32)


def build_plan(step_id: int, batch: ScheduledBatch, constants: PlanConstants,
               constraints: Constraints | None = None) -> StepPlan:
    """The plan every rank receives. Members keep the batch order. Constrained members that
    sample get a bitmask row (none in the common case: NO_MASKS, nothing computed)."""
    assert len(batch), "a plan needs at least one member"
    requests = batch.requests
    num_scheduled = np.array(batch.num_scheduled_tokens, dtype=np.int32)  # int32 [num_seqs]
    sample_mask = np.array(batch.sample, dtype=np.bool_)  # bool [num_seqs]
    cu_block_ids, block_ids = _ragged([r.block_ids for r in requests])
    return StepPlan(
        step_id=step_id,
        request_ids=[r.label for r in requests],
        input_ids=_input_ids(batch, num_scheduled),
        num_computed_tokens=np.array(batch.num_computed_tokens, dtype=np.int32),  # int32 [num_seqs]
        num_scheduled_tokens=num_scheduled,
        cu_block_ids=cu_block_ids,
        block_ids=block_ids,
        sample_mask=sample_mask,
        sampling=_sampling_columns(batch, constants, sample_mask),
        grammar=constraints.masks(requests, batch.grammar_rows) if batch.grammar_rows else NO_MASKS,
    )


def _sampling_columns(batch: ScheduledBatch, constants: PlanConstants,
                      sample_mask: np.ndarray) -> SamplingColumns:
    """Every member's constants row, its biases and penalty history when it samples, and its
    prompt logprob asks."""
    requests = batch.requests
    values, seeds = constants.gather(np.array([r.slot for r in requests], dtype=np.int64))
    if batch.padding_rows:
        values[batch.padding_rows] = PADDING_ROW
        seeds[batch.padding_rows] = 0
    biased = np.flatnonzero(sample_mask & (values[:, HAS_BIAS] > 0))
    penalised = np.flatnonzero(sample_mask & (values[:, HAS_PENALTIES] > 0))
    num_prompt_logprobs, next_prompt_token_ids = _prompt_logprob_asks(batch)
    return SamplingColumns.from_rows(values[:, :NUM_PARAMS], seeds, _logit_bias(requests, biased),
                                     _penalty_history(requests, penalised),
                                     num_prompt_logprobs=num_prompt_logprobs,
                                     next_prompt_token_ids=next_prompt_token_ids)


def _input_ids(batch: ScheduledBatch, num_scheduled: np.ndarray) -> np.ndarray:
    """int32 [num_tokens]: one-token members from the batch's list, chunks sliced from their tokens."""
    input_ids = np.empty(batch.num_tokens, dtype=np.int32)  # int32 [num_tokens]
    starts = np.zeros(len(num_scheduled), dtype=np.int64)  # int64 [num_seqs] offset of each member
    np.cumsum(num_scheduled[:-1], out=starts[1:])
    input_ids[starts[num_scheduled == 1]] = batch.single_token_ids
    for row in batch.chunk_rows:
        start, count = int(starts[row]), batch.num_scheduled_tokens[row]
        position = batch.num_computed_tokens[row]
        input_ids[start:start + count] = batch.requests[row].token_ids[position:position + count]
    return input_ids


def _prompt_logprob_asks(batch: ScheduledBatch) -> tuple[np.ndarray, np.ndarray]:
    """(num_prompt_logprobs, next_prompt_token_ids), int32 [num_seqs] each, -1 where not asked.

    A member owing prompt logprobs names the prompt token right after its chunk (when there is
    one), so the worker can score it with the chunk's last logits (see proto StepResult).
    """
    num_prompt_logprobs = np.full(len(batch), -1, dtype=np.int32)  # int32 [num_seqs]
    next_prompt_token_ids = np.full(len(batch), -1, dtype=np.int32)  # int32 [num_seqs]
    for row in batch.prompt_logprob_rows:
        request = batch.requests[row]
        num_prompt_logprobs[row] = request.sampling_params.prompt_logprobs
        end = batch.num_computed_tokens[row] + batch.num_scheduled_tokens[row]
        if end < request.num_prompt_tokens:
            next_prompt_token_ids[row] = request.token_at(end)
    return num_prompt_logprobs, next_prompt_token_ids


def _ragged(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int32 [n + 1], values int32 [total]) for a list of int32 arrays."""
    lengths = np.array([len(a) for a in arrays], dtype=np.int32)  # int32 [n]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)  # int32 [n + 1]
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(np.int32, copy=False) if arrays else _EMPTY_INT32
    return offsets, values


def _logit_bias(requests: Sequence[Request], rows: np.ndarray) -> LogitBias:
    """Sparse (row, token, value) logit adjustments of the sampling members with any."""
    row_ids, token_ids, values = [], [], []
    for row in rows.tolist():
        bias = active_bias(requests[row])
        if len(bias.token_ids):
            row_ids.append(np.full(len(bias.token_ids), row, dtype=np.int32))
            token_ids.append(bias.token_ids)
            values.append(bias.values)
    if not row_ids:
        return LogitBias()
    # int32 [num_biases], int32 [num_biases], float32 [num_biases]
    return LogitBias(np.concatenate(row_ids), np.concatenate(token_ids), np.concatenate(values))


def _penalty_history(requests: Sequence[Request], rows: np.ndarray) -> PenaltyHistory:
    """Prompt + output ids of the sampling members with active penalties; empty ranges elsewhere."""
    num_prompt = np.zeros(len(requests), dtype=np.int32)  # int32 [num_seqs]
    lengths = np.zeros(len(requests), dtype=np.int32)  # int32 [num_seqs]
    histories = []
    for row in rows.tolist():
        request = requests[row]
        histories.append(request.token_ids)
        lengths[row] = request.num_tokens
        num_prompt[row] = request.num_prompt_tokens
    cu_history = np.zeros(len(requests) + 1, dtype=np.int32)  # int32 [num_seqs + 1]
    np.cumsum(lengths, out=cu_history[1:])
    history_token_ids = np.concatenate(histories) if histories else _EMPTY_INT32  # int32 [total_history]
    return PenaltyHistory(cu_history, history_token_ids, num_prompt)
