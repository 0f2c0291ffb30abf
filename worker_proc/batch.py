"""Turns a StepPlan into flat model inputs and attention metadata, once per step (numpy, O(tokens))."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from proto.messages import StepPlan
from proto.sampling import SamplingParams
from proto.sampling_columns import SamplingColumns
from worker_proc.attention import AttentionMetadata, DecodeGroup, PrefillSpan

# Splitting decodes into a short and a long group costs one more set of kernel launches per layer
# (~85 us on CPU) and saves gathering the padding (~0.15 us a slot): split only when it saves this
# many padded slots, with margin. 32 decodes of 300-1000 tokens: 9% less attention time.
MIN_SPLIT_SAVED_SLOTS = 1024


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_sampled] last token row of each sampling member
    sample_members: np.ndarray  # int64 [num_sampled] member index of each sampled row
    sample_positions: np.ndarray  # int64 [num_sampled] position the sampled token will occupy

    def to(self, device: torch.device) -> StepBatch:
        """Built on the CPU from numpy; moved once per step when the model lives elsewhere."""
        if device.type == "cpu":
            return self
        return replace(self, input_ids=self.input_ids.to(device, non_blocking=True),
                       positions=self.positions.to(device, non_blocking=True),
                       attn=self.attn.to(device),
                       logits_indices=self.logits_indices.to(device, non_blocking=True))


def build_step_batch(plan: StepPlan, block_size: int, num_kv_blocks: int,
                     packed_context: bool = False) -> StepBatch:
    """Raises ValueError (naming the member) when a block table cannot hold the member's context.
    packed_context also lists every member's context slots (for a gathering varlen backend)."""
    num_scheduled = plan.num_scheduled_tokens.astype(np.int64)
    num_computed = plan.num_computed_tokens.astype(np.int64)
    context_lens = num_computed + num_scheduled  # int64 [num_seqs]
    cu_seqlens_q = np.zeros(plan.num_seqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])
    member = np.repeat(np.arange(plan.num_seqs), num_scheduled)  # int64 [num_tokens]
    positions = num_computed[member] + (np.arange(num_tokens) - cu_seqlens_q[member])
    block_tables = _padded_block_tables(plan, context_lens, block_size, num_kv_blocks)
    slot_mapping = _slots(block_tables, member, positions, block_size)  # int64 [num_tokens]

    is_decode = num_scheduled == 1
    decodes = _decode_groups(np.flatnonzero(is_decode), cu_seqlens_q, block_tables, context_lens,
                             block_size, all_decodes=bool(is_decode.all()))
    prefills = tuple(_prefill_span(block_tables, int(i), int(cu_seqlens_q[i]), int(num_computed[i]),
                                   int(context_lens[i]), block_size)
                     for i in np.flatnonzero(~is_decode))
    attn = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping),
        cu_seqlens_q=torch.from_numpy(cu_seqlens_q.astype(np.int32)),
        block_tables=torch.from_numpy(block_tables.astype(np.int32)),
        max_seqlen_q=int(num_scheduled.max()),
        max_context_len=int(context_lens.max()),
        decodes=decodes,
        prefills=prefills,
        cu_seqlens_k=torch.from_numpy(np.concatenate([[0], np.cumsum(context_lens)]).astype(np.int32)),
        context_slots=(torch.from_numpy(_packed_context_slots(block_tables, context_lens, block_size))
                       if packed_context else None),
        token_members=torch.from_numpy(member.astype(np.int32)),
        token_context_lens=torch.from_numpy((positions + 1).astype(np.int32)),
    )
    sample_members = np.flatnonzero(plan.sample_mask)
    return StepBatch(
        input_ids=torch.from_numpy(plan.input_ids.astype(np.int64)),
        positions=torch.from_numpy(positions),
        attn=attn,
        logits_indices=torch.from_numpy(cu_seqlens_q[sample_members + 1] - 1),
        sample_members=sample_members,
        sample_positions=context_lens[sample_members],
    )


def _padded_block_tables(plan: StepPlan, context_lens: np.ndarray, block_size: int,
                         num_kv_blocks: int) -> np.ndarray:
    """int64 [num_seqs, max_blocks]; rows shorter than max_blocks are padded with block 0."""
    blocks_per_seq = np.diff(plan.cu_block_ids).astype(np.int64)
    short = np.flatnonzero(blocks_per_seq * block_size < context_lens)
    if len(short):
        i = int(short[0])
        raise ValueError(f"member {plan.request_ids[i]!r} has {blocks_per_seq[i]} KV blocks of "
                         f"{block_size} tokens for a context of {context_lens[i]} tokens")
    if len(plan.block_ids) and (plan.block_ids.min() < 0 or plan.block_ids.max() >= num_kv_blocks):
        raise ValueError(f"block ids must be in [0, {num_kv_blocks}), got "
                         f"[{plan.block_ids.min()}, {plan.block_ids.max()}]")
    max_blocks = int(blocks_per_seq.max())
    offsets = np.arange(max_blocks)
    index = plan.cu_block_ids[:-1, None].astype(np.int64) + offsets
    valid = offsets < blocks_per_seq[:, None]
    return np.where(valid, plan.block_ids.astype(np.int64)[np.where(valid, index, 0)], 0)


def _decode_groups(members: np.ndarray, cu_seqlens_q: np.ndarray, block_tables: np.ndarray,
                   context_lens: np.ndarray, block_size: int, all_decodes: bool) -> tuple[DecodeGroup, ...]:
    """members: int64 [num_decodes] batch indices. One group, or two (shorter and longer contexts)
    when that saves at least MIN_SPLIT_SAVED_SLOTS of padding."""
    if not len(members):
        return ()
    lens = context_lens[members]
    order = np.argsort(lens, kind="stable")
    sorted_lens = lens[order]
    num = len(members)
    cuts = np.arange(1, num)  # the first `cut` of the sorted members form the short group
    padded = cuts * sorted_lens[:-1] + (num - cuts) * sorted_lens[-1]  # int64 [num - 1]
    if num < 2 or num * sorted_lens[-1] - padded.min() < MIN_SPLIT_SAVED_SLOTS:
        parts = [members]
    else:
        cut = int(cuts[padded.argmin()])
        parts = [members[np.sort(order[:cut])], members[np.sort(order[cut:])]]
    whole_step = all_decodes and len(parts) == 1
    return tuple(_decode_group(None if whole_step else torch.from_numpy(cu_seqlens_q[part]),
                               block_tables[part], context_lens[part], block_size)
                 for part in parts)


def _decode_group(token_rows: torch.Tensor | None, block_tables: np.ndarray, context_lens: np.ndarray,
                  block_size: int) -> DecodeGroup:
    """Slots of every member's context, padded to the longest with the member's last slot
    (already written, so never garbage) and an additive mask hiding the padding."""
    max_len = int(context_lens.max())
    offsets = np.arange(max_len)
    positions = np.minimum(offsets, context_lens[:, None] - 1)  # int64 [num_members, max_len]
    rows = np.arange(len(context_lens))[:, None]
    slots = torch.from_numpy(_slots(block_tables, rows, positions, block_size))
    if int(context_lens.min()) == max_len:
        return DecodeGroup(token_rows, slots, None)
    padding = offsets >= context_lens[:, None]  # bool [num_members, max_len]
    mask = np.where(padding, np.float32(-np.inf), np.float32(0))[:, None, :]
    return DecodeGroup(token_rows, slots, torch.from_numpy(mask))


def _slots(block_tables: np.ndarray, rows: np.ndarray | int, positions: np.ndarray,
           block_size: int) -> np.ndarray:
    """int64, shaped like positions: the cache slot of position p of member rows (broadcast)."""
    return block_tables[rows, positions // block_size] * block_size + positions % block_size


def _packed_context_slots(block_tables: np.ndarray, context_lens: np.ndarray,
                          block_size: int) -> np.ndarray:
    """int64 [total_context]: positions 0..context_len-1 of every member, in batch order, as slots."""
    members = np.repeat(np.arange(len(context_lens)), context_lens)
    starts = np.cumsum(context_lens) - context_lens
    positions = np.arange(len(members)) - starts[members]
    return _slots(block_tables, members, positions, block_size)


def _prefill_span(block_tables: np.ndarray, member: int, token_start: int, num_computed: int,
                  context_len: int, block_size: int) -> PrefillSpan:
    token_end = token_start + context_len - num_computed
    if num_computed == 0:
        return PrefillSpan(token_start, token_end, None, None)
    context = np.arange(context_len)
    slots = _slots(block_tables, member, context, block_size)
    query_positions = np.arange(num_computed, context_len)
    mask = context[None, :] <= query_positions[:, None]  # bool [num_q, context_len]
    return PrefillSpan(token_start, token_end, torch.from_numpy(slots), torch.from_numpy(mask))


def synthetic_plan(step_id: int, contexts: np.ndarray, num_scheduled: np.ndarray,
                   input_ids: np.ndarray, max_blocks: int) -> StepPlan:
    """A plan of greedy members with contexts[i] tokens, the last num_scheduled[i] of them
    computed now; member i owns blocks [i * max_blocks, (i + 1) * max_blocks). For benchmarks and
    the GPU memory profile step."""
    n = len(contexts)
    i32 = np.int32
    return StepPlan(
        step_id=step_id, request_ids=[f"r{i}" for i in range(n)], input_ids=input_ids.astype(i32),
        num_computed_tokens=(contexts - num_scheduled).astype(i32),
        num_scheduled_tokens=num_scheduled.astype(i32),
        cu_block_ids=(np.arange(n + 1) * max_blocks).astype(i32),
        block_ids=np.arange(n * max_blocks, dtype=i32), sample_mask=np.ones(n, bool),
        sampling=SamplingColumns.of_params([SamplingParams(temperature=0.0)] * n))
