"""What the torch reference reads about one step: padded decode groups and prefill spans (numpy, O(tokens))."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_proc.attention import RaggedBatch

# Splitting decodes into a short and a long group costs one more set of kernel launches per layer
# (~85 us on CPU) and saves gathering the padding (~0.15 us a slot): split only when it saves this
# many padded slots, with margin. 32 decodes of 300-1000 tokens: 9% less attention time.
MIN_SPLIT_SAVED_SLOTS = 1024


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token members attended together, each context padded to the group's longest."""

    # None when the group is the whole step (every token a decode): rows 0..n-1 in order.
    token_rows: torch.Tensor | None  # int64 [num_members] query row of each member
    slots: torch.Tensor  # int64 [num_members, max_context] padded with the member's last slot
    mask: torch.Tensor | None  # float32 [num_members, 1, max_context] 0 or -inf; None = no padding


@dataclass(frozen=True)
class PrefillSpan:
    """One multi-token member (a prefill chunk): its query rows and what it attends to."""

    token_start: int
    token_end: int
    # None when the chunk starts at position 0: it attends only to itself, causally.
    context_slots: torch.Tensor | None  # int64 [context_len] cache slot of every context position
    mask: torch.Tensor | None  # bool [num_q, context_len] True = may attend (causal with offset)


@dataclass(frozen=True)
class ReferenceMetadata:
    """Invariant: slot_mapping[t] is where token t's K/V are written before any layer reads them, so
    a member's context (cached prefix + this step's tokens) is always fully present in the cache."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    # Single-token members in one or two groups of similar context length (less padding).
    decodes: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillSpan, ...]


def build_reference_metadata(batch: RaggedBatch) -> ReferenceMetadata:
    is_decode = batch.num_scheduled == 1
    decodes = _decode_groups(batch, np.flatnonzero(is_decode), all_decodes=bool(is_decode.all()))
    prefills = tuple(prefill_span(batch, int(i)) for i in np.flatnonzero(~is_decode))
    return ReferenceMetadata(torch.from_numpy(batch.slot_mapping), decodes, prefills)


def _decode_groups(batch: RaggedBatch, members: np.ndarray, all_decodes: bool) -> tuple[DecodeGroup, ...]:
    """members: int64 [num_decodes] batch indices. One group, or two (shorter and longer contexts)
    when that saves at least MIN_SPLIT_SAVED_SLOTS of padding."""
    if not len(members):
        return ()
    lens = batch.context_lens[members]
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
    return tuple(_decode_group(batch, part, None if whole_step else torch.from_numpy(batch.cu_seqlens_q[part]))
                 for part in parts)


def _decode_group(batch: RaggedBatch, members: np.ndarray, token_rows: torch.Tensor | None) -> DecodeGroup:
    """Slots of every member's context, padded to the longest with the member's last slot
    (already written, so never garbage) and an additive mask hiding the padding."""
    context_lens = batch.context_lens[members]
    max_len = int(context_lens.max())
    offsets = np.arange(max_len)
    positions = np.minimum(offsets, context_lens[:, None] - 1)  # int64 [num_members, max_len]
    slots = torch.from_numpy(batch.slots(members[:, None], positions))
    if int(context_lens.min()) == max_len:
        return DecodeGroup(token_rows, slots, None)
    padding = offsets >= context_lens[:, None]  # bool [num_members, max_len]
    mask = np.where(padding, np.float32(-np.inf), np.float32(0))[:, None, :]
    return DecodeGroup(token_rows, slots, torch.from_numpy(mask))


def prefill_span(batch: RaggedBatch, member: int) -> PrefillSpan:
    """Member's chunk: its query rows, and unless it starts at position 0 its context's slots and
    causal mask (also what the native backend hands SDPA for long bf16 chunks)."""
    token_start = int(batch.cu_seqlens_q[member])
    num_computed, context_len = int(batch.num_computed[member]), int(batch.context_lens[member])
    token_end = token_start + context_len - num_computed
    if num_computed == 0:
        return PrefillSpan(token_start, token_end, None, None)
    context = np.arange(context_len)
    slots = batch.slots(member, context)
    query_positions = np.arange(num_computed, context_len)
    mask = context[None, :] <= query_positions[:, None]  # bool [num_q, context_len]
    return PrefillSpan(token_start, token_end, torch.from_numpy(slots), torch.from_numpy(mask))
