"""CPU fast path: attention reads K/V straight from the paged cache in a native kernel (native_kernel.py).

The reference gathers every decode member's context into a scratch buffer (one copy of K and V)
and then runs batched matmuls whose GQA groups are a few rows tall; the kernel reads each K/V row
once, in place, for the KV head's whole group. Every token of the step is one query of the same
kernel call: a decode attends to its whole context, a prefill chunk's token at position p to the
first p + 1 positions (this step's K/V are written to the cache first). The cache layout and the
writes are the reference's own. SmolLM2-135M: docs/benchmarks.md "Decode attention on the CPU".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_proc.attention import RaggedBatch
from worker_proc.attention.native_kernel import PagedAttentionKernel
from worker_proc.attention.reference import write_kv
from worker_proc.kv_cache import KVLayout


@dataclass(frozen=True)
class NativeMetadata:
    """One query per token, read through its member's block table row."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    token_members: torch.Tensor  # int32 [num_tokens] each token's member (block table row)
    token_context_lens: torch.Tensor  # int32 [num_tokens] positions it sees (position + 1)


class NativePagedAttention:
    """Same results as the reference within rounding: fp32 softmax, scores and products in fp32
    (bf16 inputs multiply exactly), probabilities rounded to the model's dtype before p.v. Which
    code path runs (and whether auto picks this backend at all) is the selector's choice."""

    gathers_context = False
    kv_layout = KVLayout.HEADS_MAJOR

    def __init__(self, kernel: PagedAttentionKernel, block_size: int) -> None:
        self.kernel = kernel
        self.block_size = block_size

    def build_metadata(self, batch: RaggedBatch) -> NativeMetadata:
        return NativeMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping),
            block_tables=torch.from_numpy(batch.block_tables.astype(np.int32)),
            token_members=torch.from_numpy(batch.token_members.astype(np.int32)),
            token_context_lens=torch.from_numpy((batch.positions + 1).astype(np.int32)))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: NativeMetadata) -> torch.Tensor:
        """Shapes as AttentionBackend.forward."""
        num_tokens, num_heads, head_dim = q.shape
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)  # [num_tokens, num_heads, head_dim]
        self.kernel(q, out, k_cache, v_cache, meta.block_tables, meta.token_members, meta.token_context_lens,
                    self.block_size, torch.get_num_threads())
        return out.view(num_tokens, num_heads * head_dim)
