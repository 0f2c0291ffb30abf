"""The torch reference backend (CPU and GPU): paged attention in plain torch, what the others must equal."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from worker_proc.attention import RaggedBatch
from worker_proc.attention.reference_metadata import (
    DecodeGroup,
    PrefillSpan,
    ReferenceMetadata,
    build_reference_metadata,
)
from worker_proc.kv_cache import KVLayout


class TorchPagedAttention:
    """Reference backend (CPU and GPU): batched matmuls for decodes, SDPA for prefill chunks, over
    K/V gathered from a HEADS_MAJOR cache, k_cache and v_cache [num_kv_heads, num_slots, head_dim].
    Over a cache of another dtype than q's (--kv-cache-dtype) it computes in q's: an fp32 model
    over a bf16 cache widens the K/V it gathers, so a CPU without native bf16 (where the native
    kernel does not build, or with --attention-backend torch) never multiplies bf16 in emulation.
    The model hands it such q only on the CPU and only over a narrower cache (model.Attention)."""

    gathers_context = True
    kv_layout = KVLayout.HEADS_MAJOR
    mixed_dtypes = True

    def __init__(self) -> None:
        self.scratch = ScratchBuffers()

    def build_metadata(self, batch: RaggedBatch) -> ReferenceMetadata:
        return build_reference_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: ReferenceMetadata) -> torch.Tensor:
        """Shapes as AttentionBackend.forward."""
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        out = self.decode(q, k_cache, v_cache, meta)
        if meta.prefills:
            self.prefill(q, k, v, k_cache, v_cache, meta, out)
        return out.view(num_tokens, num_heads * head_dim)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: ReferenceMetadata) -> torch.Tensor:
        """[num_tokens, num_heads, head_dim] with every decode row attended; prefill rows unset."""
        if len(meta.decodes) == 1 and meta.decodes[0].token_rows is None:  # nothing to scatter
            return _decode(q, k_cache, v_cache, meta.decodes[0], self.scratch)
        out = q.new_empty(q.shape)
        for group in meta.decodes:
            out[group.token_rows] = _decode(q[group.token_rows], k_cache, v_cache, group, self.scratch)
        return out

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: ReferenceMetadata, out: torch.Tensor) -> None:
        """Writes every prefill chunk's rows of out [num_tokens, num_heads, head_dim]."""
        for span in meta.prefills:
            out[span.token_start:span.token_end] = prefill_chunk(q, k, v, k_cache, v_cache, span)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """This step's k, v [num_tokens, num_kv_heads, head_dim] into HEADS_MAJOR caches at slot_mapping
    (rounded to the cache's dtype where it is another)."""
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


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

    Two matmuls in q's dtype (K/V gathered in the cache's, widened when q's is another), the softmax
    in fp32; fp32 stays fp32 throughout. In bf16 this skips fp32 SDPA's cast copy of K/V, and rounding
    the scores to bf16 costs no measurable accuracy: SmolLM2-135M's next-token KL to its fp32 self is 0.0011 either way."""
    num_members, context = group.slots.shape
    num_kv_heads, _, head_dim = k_cache.shape
    flat_slots = group.slots.view(-1)
    gathered = (num_kv_heads, num_members * context, head_dim)
    keys = torch.index_select(k_cache, 1, flat_slots, out=scratch.get("keys", gathered, k_cache))
    values = torch.index_select(v_cache, 1, flat_slots, out=scratch.get("values", gathered, v_cache))
    if keys.dtype != q.dtype:  # an fp32 model over a bf16 cache: widened into scratch of their own
        keys = scratch.get("wide_keys", gathered, q).copy_(keys)
        values = scratch.get("wide_values", gathered, q).copy_(values)
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


def prefill_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    """One chunk's queries against its context -> [num_q, num_heads, head_dim] (one SDPA call)."""
    rows = slice(span.token_start, span.token_end)
    queries = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, num_q, head_dim]
    if span.context_slots is None:
        keys, values, causal = (k[rows].to(k_cache.dtype).to(q.dtype).transpose(0, 1),  # as cached
                                v[rows].to(v_cache.dtype).to(q.dtype).transpose(0, 1), True)
    else:  # the gather is already [kv_heads, context, head_dim], SDPA's layout
        keys, values, causal = (k_cache.index_select(1, span.context_slots).to(q.dtype),
                                v_cache.index_select(1, span.context_slots).to(q.dtype), False)
    out = F.scaled_dot_product_attention(queries, keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=span.mask, is_causal=causal, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
