"""Turn the scheduled members of a step into one proto StepPlan: O(batch) numpy, no per-token loops."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from proto.messages import StepPlan
from scheduler_proc.policy import ScheduledSeq
from scheduler_proc.stop import active_bias

_EMPTY_INT32 = np.empty(0, dtype=np.int32)


def build_plan(step_id: int, seqs: Sequence[ScheduledSeq]) -> StepPlan:
    """The plan every rank receives. Members keep the order of `seqs` (the batch order)."""
    assert seqs, "a plan needs at least one member"
    num_seqs = len(seqs)
    requests = [seq.request for seq in seqs]
    num_computed = np.fromiter((s.num_computed_tokens for s in seqs), np.int32, num_seqs)  # [num_seqs]
    num_scheduled = np.fromiter((s.num_scheduled_tokens for s in seqs), np.int32, num_seqs)  # [num_seqs]
    input_ids = np.concatenate([  # int32 [num_tokens]
        s.request.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_scheduled_tokens]
        for s in seqs])
    cu_block_ids, block_ids = _ragged([r.block_ids for r in requests])
    sample_mask = np.fromiter((s.sample for s in seqs), np.bool_, num_seqs)  # bool [num_seqs]
    rows = np.array([r.sampling_row for r in requests], dtype=np.float64)  # float64 [num_seqs, 7]
    bias_rows, bias_token_ids, bias_values = _bias_triples(seqs)
    cu_history, history_token_ids, history_num_prompt = _penalty_history(seqs)
    return StepPlan(
        step_id=step_id,
        request_ids=[r.request_id for r in requests],
        input_ids=input_ids,
        num_computed_tokens=num_computed,
        num_scheduled_tokens=num_scheduled,
        cu_block_ids=cu_block_ids,
        block_ids=block_ids,
        sample_mask=sample_mask,
        temperature=rows[:, 0].astype(np.float32),
        top_p=rows[:, 1].astype(np.float32),
        top_k=rows[:, 2].astype(np.int32),
        min_p=rows[:, 3].astype(np.float32),
        repetition_penalty=rows[:, 4].astype(np.float32),
        presence_penalty=rows[:, 5].astype(np.float32),
        frequency_penalty=rows[:, 6].astype(np.float32),
        seeds=np.fromiter((r.seed for r in requests), np.int64, num_seqs),  # int64 [num_seqs]
        bias_rows=bias_rows,
        bias_token_ids=bias_token_ids,
        bias_values=bias_values,
        cu_history=cu_history,
        history_token_ids=history_token_ids,
        history_num_prompt=history_num_prompt,
    )


def _ragged(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int32 [n + 1], values int32 [total]) for a list of int32 arrays."""
    lengths = np.fromiter((len(a) for a in arrays), np.int32, len(arrays))  # int32 [n]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)  # int32 [n + 1]
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(np.int32, copy=False) if arrays else _EMPTY_INT32
    return offsets, values


def _bias_triples(seqs: Sequence[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sparse (row, token, value) logit adjustments for the members that sample this step."""
    rows, token_ids, values = [], [], []
    for row, seq in enumerate(seqs):
        if not seq.sample:
            continue
        bias = active_bias(seq.request)
        if len(bias.token_ids):
            rows.append(np.full(len(bias.token_ids), row, dtype=np.int32))
            token_ids.append(bias.token_ids)
            values.append(bias.values)
    if not rows:
        return _EMPTY_INT32, _EMPTY_INT32, np.empty(0, dtype=np.float32)
    # int32 [num_biases], int32 [num_biases], float32 [num_biases]
    return np.concatenate(rows), np.concatenate(token_ids), np.concatenate(values)


def _penalty_history(seqs: Sequence[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt + output ids of sampling members with active penalties; empty ranges elsewhere."""
    histories: list[np.ndarray] = []
    num_prompt = np.zeros(len(seqs), dtype=np.int32)  # int32 [num_seqs]
    for row, seq in enumerate(seqs):
        request = seq.request
        if seq.sample and request.sampling_params.has_penalties:
            histories.append(request.token_ids)
            num_prompt[row] = request.num_prompt_tokens
        else:
            histories.append(_EMPTY_INT32)
    cu_history, history_token_ids = _ragged(histories)
    return cu_history, history_token_ids, num_prompt
