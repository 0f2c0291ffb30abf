"""Attention backends behind one small interface; the pure-torch paged attention is the reference."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Protocol

import torch
import torch.nn.functional as F

from worker_proc.kv_cache import KVLayout


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
class AttentionMetadata:
    """Everything attention needs about one ragged step; built once per step, shared by all layers.

    Invariant: slot_mapping[t] is where token t's K/V are written before any layer reads them, so a
    member's context (cached prefix + this step's tokens) is always fully present in the cache.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    max_seqlen_q: int
    max_context_len: int
    # Single-token members in one or two groups of similar context length (less padding).
    decodes: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillSpan, ...]
    # For varlen kernels (attention_varlen): the whole ragged batch at once.
    cu_seqlens_k: torch.Tensor | None = None  # int32 [num_seqs + 1] offsets of each member's context
    context_slots: torch.Tensor | None = None  # int64 [total_context] every member's context, packed
    # For kernels that read the paged cache through block_tables, one query per token (attention_native).
    token_members: torch.Tensor | None = None  # int32 [num_tokens] each token's member (block table row)
    token_context_lens: torch.Tensor | None = None  # int32 [num_tokens] positions it sees (position + 1)

    def to(self, device: torch.device) -> AttentionMetadata:
        moved = {f.name: _move(getattr(self, f.name), device) for f in fields(self)}
        moved["decodes"] = tuple(DecodeGroup(*(_move(getattr(g, f.name), device) for f in fields(g)))
                                 for g in self.decodes)
        moved["prefills"] = tuple(PrefillSpan(*(_move(getattr(p, f.name), device) for f in fields(p)))
                                  for p in self.prefills)
        return AttentionMetadata(**moved)


def _move(value: object, device: torch.device) -> object:
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


class AttentionBackend(Protocol):
    # True when the step's AttentionMetadata must carry context_slots (built only when asked).
    needs_packed_context: bool
    # True when decodes copy each member's context out of the cache (a per-layer scratch of up to
    # max_num_seqs x max_model_len tokens of K and V that the GPU memory budget must leave room for).
    gathers_context: bool
    # How the runner lays out the KV cache for this backend (kv_cache.KVLayout).
    kv_layout: KVLayout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        k_cache, v_cache: flat views in kv_layout, kv_layout.shape((num_slots,), kv_heads, head_dim).
        Writes this step's k, v into the caches and returns [num_tokens, num_heads * head_dim]."""
        ...


class TorchPagedAttention:
    """Reference backend (CPU and GPU): batched matmuls for decodes, SDPA for prefill chunks, over
    K/V gathered from a HEADS_MAJOR cache, k_cache and v_cache [num_kv_heads, num_slots, head_dim]."""

    needs_packed_context = False
    gathers_context = True
    kv_layout = KVLayout.HEADS_MAJOR

    def __init__(self) -> None:
        self.scratch = ScratchBuffers()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta)
        num_tokens, num_heads, head_dim = q.shape
        out = self.decode(q, k_cache, v_cache, meta)
        if meta.prefills:
            self.prefill(q, k, v, k_cache, v_cache, meta, out)
        return out.view(num_tokens, num_heads * head_dim)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """[num_tokens, num_heads, head_dim] with every decode row attended; prefill rows unset."""
        if len(meta.decodes) == 1 and meta.decodes[0].token_rows is None:  # nothing to scatter
            return _decode(q, k_cache, v_cache, meta.decodes[0], self.scratch)
        out = q.new_empty(q.shape)
        for group in meta.decodes:
            out[group.token_rows] = _decode(q[group.token_rows], k_cache, v_cache, group, self.scratch)
        return out

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Writes every prefill chunk's rows of out [num_tokens, num_heads, head_dim]."""
        for span in meta.prefills:
            out[span.token_start:span.token_end] = _prefill(q, k, v, k_cache, v_cache, span)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """This step's k, v [num_tokens, num_kv_heads, head_dim] into HEADS_MAJOR caches at slot_mapping."""
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))


class ScratchBuffers:
    """Grow-only buffers that every layer of every step reuses for the decode gathers.

    A fresh multi-megabyte tensor per layer is mmapped by glibc and page-faulted in on first
    touch, which cost more than the attention itself (SmolLM2-135M, 32 decodes: 475 ms a step
    against 200 ms). Holds at most the largest step's gathered K and V."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Uninitialised, contiguous, with like's dtype and device; valid until the next get(name)."""
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if (buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype
                or buffer.device != like.device):
            # Headroom: contexts grow a token a step, so an exact fit would regrow every step.
            buffer = like.new_empty(numel + numel // 4)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
            scratch: ScratchBuffers) -> torch.Tensor:
    """q: [num_members, num_heads, head_dim] -> same shape.

    Two matmuls in the model's dtype, the softmax in fp32; fp32 models stay fp32 throughout. On
    bf16 models this skips fp32 SDPA's cast copy of K/V, and rounding the scores to bf16 costs no
    measurable accuracy: SmolLM2-135M's next-token KL to its fp32 self is 0.0011 either way."""
    num_members, context = group.slots.shape
    num_kv_heads, _, head_dim = k_cache.shape
    flat_slots = group.slots.view(-1)
    gathered = (num_kv_heads, num_members * context, head_dim)
    keys = torch.index_select(k_cache, 1, flat_slots, out=scratch.get("keys", gathered, k_cache))
    values = torch.index_select(v_cache, 1, flat_slots, out=scratch.get("values", gathered, v_cache))
    keys = keys.view(num_kv_heads, num_members, context, head_dim)
    values = values.view(num_kv_heads, num_members, context, head_dim)
    # A KV head's query heads (its GQA group) become rows of one matmul, so K/V are read once.
    queries = q.view(num_members, num_kv_heads, -1, head_dim).transpose(0, 1)  # [kv_heads, n, group, dim]
    scores = torch.matmul(queries, keys.transpose(-1, -2)).float()  # [kv_heads, n, group, context]
    scores.mul_(head_dim ** -0.5)
    if group.mask is not None:
        scores.add_(group.mask)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values)  # [kv_heads, n, group, head_dim]
    return out.transpose(0, 1).reshape(num_members, -1, head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    """One chunk's queries against its context -> [num_q, num_heads, head_dim]."""
    rows = slice(span.token_start, span.token_end)
    queries = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, num_q, head_dim]
    if span.context_slots is None:
        keys, values, causal = k[rows].transpose(0, 1), v[rows].transpose(0, 1), True
    else:  # the gather is already [kv_heads, context, head_dim], SDPA's layout
        keys, values, causal = (k_cache.index_select(1, span.context_slots),
                                v_cache.index_select(1, span.context_slots), False)
    out = F.scaled_dot_product_attention(queries, keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=span.mask, is_causal=causal, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
