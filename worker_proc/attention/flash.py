"""GPU fast path: the whole ragged step (prefill chunks and decodes) in one flash-attn varlen call.

Where the reference backend loops over prefill chunks and pads decodes, this hands flash-attn's
`flash_attn_varlen_func` the flat queries with cu_seqlens_q and each member's context with
cu_seqlens_k; causal masking is aligned bottom-right, which is exactly "query i of a chunk
sees the cached prefix plus chunk tokens up to i". flash-attn 2 reads K/V through a block table
only with pages of a multiple of 256 tokens, so with the default 16-token blocks the context is
first gathered into one packed buffer (one index_select per layer); with --block-size 256 (or a
multiple) the kernel reads the paged cache directly.

The kernel is injected, so the argument mapping can be checked on the CPU against the reference
with a plain-torch implementation of the same contract (tests/worker_proc).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from worker_proc.attention import RaggedBatch
from worker_proc.kv_cache import KVLayout

PAGED_BLOCK_MULTIPLE = 256  # flash-attn 2 refuses a block table with smaller pages
# flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
#                        causal, block_table=None) -> [num_tokens, num_heads, head_dim]
VarlenKernel = Callable[..., torch.Tensor]


def load_flash_kernel() -> VarlenKernel | None:
    """flash-attn's varlen kernel when the package is installed and importable, else None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@dataclass(frozen=True)
class VarlenMetadata:
    """The whole ragged step at once: queries by cu_seqlens_q, contexts by cu_seqlens_k."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    cu_seqlens_k: torch.Tensor  # int32 [num_seqs + 1] offsets of each member's context
    max_seqlen_q: int
    max_context_len: int
    # Paged: the block tables the kernel reads; gathered: every member's context slots, packed.
    block_tables: torch.Tensor | None  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    context_slots: torch.Tensor | None  # int64 [total_context]


class VarlenPagedAttention:
    """One varlen kernel call per layer for the whole step; same results as the reference."""

    kv_layout = KVLayout.BLOCKS_MAJOR  # flash-attn's paged K/V: [num_blocks, block_size, kv_heads, dim]
    mixed_dtypes = False  # flash-attn takes q in the cache's dtype

    def __init__(self, kernel: VarlenKernel, block_size: int) -> None:
        self.kernel = kernel
        self.block_size = block_size
        self.paged = block_size % PAGED_BLOCK_MULTIPLE == 0

    @property
    def gathers_context(self) -> bool:
        return not self.paged

    def build_metadata(self, batch: RaggedBatch) -> VarlenMetadata:
        context_lens = batch.context_lens
        return VarlenMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping),
            cu_seqlens_q=torch.from_numpy(batch.cu_seqlens_q.astype(np.int32)),
            cu_seqlens_k=torch.from_numpy(np.concatenate([[0], np.cumsum(context_lens)]).astype(np.int32)),
            max_seqlen_q=int(batch.num_scheduled.max()),
            max_context_len=int(context_lens.max()),
            block_tables=torch.from_numpy(batch.block_tables.astype(np.int32)) if self.paged else None,
            context_slots=None if self.paged else torch.from_numpy(_packed_context_slots(batch)))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: VarlenMetadata) -> torch.Tensor:
        """Shapes as AttentionBackend.forward; writes this step's K/V first, then attends."""
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        num_tokens, num_heads, head_dim = q.shape
        if self.paged:  # [num_blocks, block_size, kv_heads, head_dim] read through block_tables
            keys = k_cache.view(-1, self.block_size, *k_cache.shape[1:])
            values = v_cache.view(-1, self.block_size, *v_cache.shape[1:])
            extra = {"block_table": meta.block_tables}
        else:  # [total_context, kv_heads, head_dim], members back to back as cu_seqlens_k says
            keys = k_cache.index_select(0, meta.context_slots)
            values = v_cache.index_select(0, meta.context_slots)
            extra = {}
        out = self.kernel(q, keys, values, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                          meta.max_context_len, causal=True, **extra)
        return out.reshape(num_tokens, num_heads * head_dim)


def _packed_context_slots(batch: RaggedBatch) -> np.ndarray:
    """int64 [total_context]: positions 0..context_len-1 of every member, in batch order, as slots."""
    context_lens = batch.context_lens
    members = np.repeat(np.arange(len(context_lens)), context_lens)
    starts = np.cumsum(context_lens) - context_lens
    return batch.slots(members, np.arange(len(members)) - starts[members])
