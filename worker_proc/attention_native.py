"""CPU fast path: attention reads K/V straight from the paged cache in a native kernel (native.py).

The reference gathers every decode member's context into a scratch buffer (one copy of K and V)
and then runs batched matmuls whose GQA groups are a few rows tall; the kernel reads each K/V row
once, in place, for the KV head's whole group. A prefill chunk's query at position p is a decode
with context p + 1 over the same block table (this step's K/V are in the cache before attention),
so chunks run through the same kernel, one work item per query, instead of SDPA. The cache layout
and writes are the reference's own (this class replaces TorchPagedAttention.decode and .prefill).
SmolLM2-135M bf16: docs/benchmarks.md "Decode attention on the CPU".
"""

from __future__ import annotations

import logging

import torch

from worker_proc.attention import AttentionMetadata, TorchPagedAttention
from worker_proc.native import PagedDecodeKernel

log = logging.getLogger(__name__)


class NativePagedAttention(TorchPagedAttention):
    """Same results as the reference within rounding: fp32 softmax, scores and products in fp32
    (bf16 inputs multiply exactly), probabilities rounded to the model's dtype before p.v.

    only_vectorised (the auto choice): where the kernel has no AVX512 path for the model's dtype
    and shape, decode with the reference instead of the kernel's slower portable loop."""

    def __init__(self, kernel: PagedDecodeKernel, block_size: int, only_vectorised: bool = False) -> None:
        super().__init__()
        self.kernel = kernel
        self.block_size = block_size
        self.only_vectorised = only_vectorised
        self._use_kernel: dict[tuple[torch.dtype, int, int], bool] = {}
        # The step whose tables passed the kernel's check_reads: every layer decodes the same
        # AttentionMetadata over same-shaped caches, so it is checked once per step, not per layer.
        # Held, not just its id(), so that a later step's object cannot reuse the address.
        self._checked_meta: AttentionMetadata | None = None
        # The step whose prefill queries were last built (and checked), with them.
        self._query_meta: AttentionMetadata | None = None
        self._queries: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        group = q.shape[1] // k_cache.shape[0]
        if self.only_vectorised and not self._kernel_covers(q.dtype, group, q.shape[2]):
            return super().decode(q, k_cache, v_cache, meta)
        members = meta.decode_members
        assert members is not None and meta.context_lens is not None, "built by batch.build_step_batch"
        out = q.new_empty(q.shape)  # [num_tokens, num_heads, head_dim]
        if len(members):
            self.kernel(q, out, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                        members, self.block_size, torch.get_num_threads(),
                        reads_checked=meta is self._checked_meta)
            self._checked_meta = meta
        return out

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> None:
        group = q.shape[1] // k_cache.shape[0]
        if self.only_vectorised and not self._kernel_covers(q.dtype, group, q.shape[2]):
            return super().prefill(q, k, v, k_cache, v_cache, meta, out)
        checked = meta is self._query_meta
        if not checked:
            self._queries, self._query_meta = prefill_queries(meta), meta
        assert self._queries is not None
        query_rows, table_rows, context_lens = self._queries
        self.kernel.attend_queries(q, out, k_cache, v_cache, meta.block_tables, query_rows, table_rows,
                                   context_lens, self.block_size, torch.get_num_threads(),
                                   reads_checked=checked)

    def _kernel_covers(self, dtype: torch.dtype, group: int, head_dim: int) -> bool:
        key = (dtype, group, head_dim)
        if key not in self._use_kernel:
            self._use_kernel[key] = self.kernel.vectorised(dtype, group, head_dim)
            if not self._use_kernel[key]:
                log.info("attention: torch reference decode: the native kernel has no vectorised path "
                         "for %s, %d query heads per KV head, head_dim %d on this CPU (needs AVX512F, and "
                         "AVX512-BF16 for bfloat16)",
                         dtype, group, head_dim)
        return self._use_kernel[key]


def prefill_queries(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query_rows int64, table_rows int64, context_lens int32), each [num_prefill_tokens]: every
    token of a multi-token member, its member and its causal context length (position + 1)."""
    assert meta.context_lens is not None, "built by batch.build_step_batch"
    cu_seqlens_q = meta.cu_seqlens_q.long()  # int64 [num_seqs + 1]
    num_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # int64 [num_seqs]
    token_members = torch.repeat_interleave(torch.arange(len(num_q)), num_q)  # int64 [num_tokens]
    query_rows = torch.nonzero(num_q[token_members] > 1).view(-1)  # int64 [num_prefill_tokens]
    table_rows = token_members[query_rows]
    # A member's last query sees its whole context; each earlier one a position less.
    context_lens = meta.context_lens[table_rows] - (cu_seqlens_q[table_rows + 1] - 1 - query_rows)
    return query_rows, table_rows.contiguous(), context_lens.to(torch.int32)
