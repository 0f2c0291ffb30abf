"""CPU fast path: attention reads K/V straight from the paged cache in a native kernel (native_kernel.py).

The reference gathers every decode member's context into a scratch buffer (one copy of K and V)
and then runs batched matmuls whose GQA groups are a few rows tall; the kernel reads each K/V row
once, in place, for the KV head's whole group. Every token of the step is one query of the same
kernel call: a decode attends to its whole context, a prefill chunk's token at position p to the
first p + 1 positions (this step's K/V are written to the cache first). The cache layout and the
writes are the reference's own. SmolLM2-135M: docs/benchmarks.md "Decode attention on the CPU".

On a CPU with AMX, bf16 prefill chunks of at least BF16_SDPA_MIN_TOKENS go to torch's SDPA instead,
one call per chunk as the reference makes it: its CPU flash kernel multiplies bf16 tiles on the
matrix units, 2.4-4.4x the kernel's per-query loop on 256-2048-token chunks there, while the kernel
stays faster on decodes and short chunks. Without AMX the kernel attends every chunk: its
AVX512-BF16 block path is 2-5x faster than SDPA there (docs/benchmarks.md "Prefill attention in
bf16").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_proc.attention import RaggedBatch
from worker_proc.attention.native_kernel import PagedAttentionKernel
from worker_proc.attention.reference import prefill_chunk, write_kv
from worker_proc.attention.reference_metadata import PrefillSpan, prefill_span
from worker_proc.kv_cache import KVLayout

# Shortest bf16 chunk that SDPA attends faster than the kernel (SmolLM2's shape, 2 threads: 0.6x at
# 32 tokens from position 0, 1.1x at 64, 2.4x at 256).
BF16_SDPA_MIN_TOKENS = 64
# A decode over more positions than this is attended in parts, which the threads share, and merged
# (the kernel's split_positions): a lone stream's 3 KV heads would keep one of 2 threads busy twice
# as long as the other. SmolLM2's shape, 2 threads, from memory: a lone decode's attention 11-15%
# faster from 600 positions on, and batches of 4-64 decodes within 3%; with parts of 256 such
# batches were 2-10% slower (docs/benchmarks.md "A lone long decode in parts").
SPLIT_POSITIONS = 512


@dataclass(frozen=True)
class NativeMetadata:
    """The kernel's queries, each read through its member's block table row, and the chunks SDPA
    takes instead."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    token_members: torch.Tensor  # int32 [num_kernel_tokens] each kernel query's member (block table row)
    token_context_lens: torch.Tensor  # int32 [num_kernel_tokens] positions it sees (position + 1)
    kernel_rows: torch.Tensor | None  # int64 [num_kernel_tokens] their rows of q; None: every row
    prefills: tuple[PrefillSpan, ...]  # the chunks of at least sdpa_min_tokens, through SDPA


class NativePagedAttention:
    """Same results as the reference within rounding: fp32 softmax, scores and products in fp32
    (bf16 inputs multiply exactly), probabilities rounded to q's dtype before p.v. Which code path
    runs (and whether auto picks this backend at all) is the selector's choice."""

    gathers_context = False
    kv_layout = KVLayout.HEADS_MAJOR

    def __init__(self, kernel: PagedAttentionKernel, block_size: int,
                 sdpa_min_tokens: int | None = None, mixed_dtypes: bool = False,
                 split_positions: int = SPLIT_POSITIONS) -> None:
        """sdpa_min_tokens: chunks of at least this many tokens go to SDPA (None: none do).
        mixed_dtypes: the kernel takes an fp32 model's q over a bf16 cache and writes fp32 (its
        mixed path, AttentionBackend.mixed_dtypes); else q arrives in the cache's dtype.
        split_positions: a decode over more positions is attended in parts (0: never; a multiple of
        16)."""
        self.kernel = kernel
        self.block_size = block_size
        self.sdpa_min_tokens = sdpa_min_tokens
        self.mixed_dtypes = mixed_dtypes
        self.split_positions = split_positions

    def build_metadata(self, batch: RaggedBatch) -> NativeMetadata:
        members, contexts = batch.token_members, batch.positions + 1
        kernel_rows, prefills = None, ()
        if self.sdpa_min_tokens is not None:
            by_sdpa = batch.num_scheduled >= max(self.sdpa_min_tokens, 2)  # [num_seqs]
            if by_sdpa.any():
                prefills = tuple(prefill_span(batch, int(m)) for m in np.flatnonzero(by_sdpa))
                rows = np.flatnonzero(~by_sdpa[members])
                members, contexts, kernel_rows = members[rows], contexts[rows], torch.from_numpy(rows)
        return NativeMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping),
            block_tables=torch.from_numpy(batch.block_tables.astype(np.int32)),
            token_members=torch.from_numpy(members.astype(np.int32)),
            token_context_lens=torch.from_numpy(contexts.astype(np.int32)),
            kernel_rows=kernel_rows, prefills=prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: NativeMetadata) -> torch.Tensor:
        """Shapes as AttentionBackend.forward."""
        num_tokens, num_heads, head_dim = q.shape
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)  # [num_tokens, num_heads, head_dim]
        if meta.kernel_rows is None:
            self._attend(q, out, k_cache, v_cache, meta)
        elif len(meta.kernel_rows):  # the decodes and short chunks: gathered, attended, put back
            queries = q.index_select(0, meta.kernel_rows)
            answers = torch.empty_like(queries)
            self._attend(queries, answers, k_cache, v_cache, meta)
            out.index_copy_(0, meta.kernel_rows, answers)
        for span in meta.prefills:
            out[span.token_start:span.token_end] = prefill_chunk(q, k, v, k_cache, v_cache, span)
        return out.view(num_tokens, num_heads * head_dim)

    def _attend(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: NativeMetadata) -> None:
        self.kernel(q, out, k_cache, v_cache, meta.block_tables, meta.token_members, meta.token_context_lens,
                    self.block_size, torch.get_num_threads(), self.split_positions)
