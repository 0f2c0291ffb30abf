"""CPU fast path: attention reads K/V straight from the paged cache in a native kernel (native.py).

The reference gathers every decode member's context into a scratch buffer (one copy of K and V)
and then runs batched matmuls whose GQA groups are a few rows tall; the kernel reads each K/V row
once, in place, for the KV head's whole group. Every token of the step is one query of the same
kernel call: a decode attends to its whole context, a prefill chunk's token at position p to the
first p + 1 positions (this step's K/V are written to the cache first). The cache layout and the
writes are the reference's own. SmolLM2-135M: docs/benchmarks.md "Decode attention on the CPU".
"""

from __future__ import annotations

import logging

import torch

from worker_proc.attention import AttentionMetadata, TorchPagedAttention, write_kv
from worker_proc.kv_cache import KVLayout
from worker_proc.native import PagedAttentionKernel

log = logging.getLogger(__name__)


class NativePagedAttention:
    """Same results as the reference within rounding: fp32 softmax, scores and products in fp32
    (bf16 inputs multiply exactly), probabilities rounded to the model's dtype before p.v.

    only_vectorised (the auto choice): where this build has only the portable C loop for the model's
    dtype and shape (slower than the reference), attend with the reference instead."""

    needs_packed_context = False
    gathers_context = False
    kv_layout = KVLayout.HEADS_MAJOR

    def __init__(self, kernel: PagedAttentionKernel, block_size: int, only_vectorised: bool = False) -> None:
        self.kernel = kernel
        self.block_size = block_size
        self.only_vectorised = only_vectorised
        self.reference = TorchPagedAttention()
        self._vectorised: dict[tuple[torch.dtype, int, int], bool] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Shapes as AttentionBackend.forward."""
        num_tokens, num_heads, head_dim = q.shape
        if self.only_vectorised and not self._has_vector_path(q.dtype, num_heads // k_cache.shape[0], head_dim):
            return self.reference.forward(q, k, v, k_cache, v_cache, meta)
        write_kv(k, v, k_cache, v_cache, meta)
        out = q.new_empty(q.shape)  # [num_tokens, num_heads, head_dim]
        self.kernel(q, out, k_cache, v_cache, meta.block_tables, meta.token_members, meta.token_context_lens,
                    self.block_size, torch.get_num_threads())
        return out.view(num_tokens, num_heads * head_dim)

    def _has_vector_path(self, dtype: torch.dtype, group: int, head_dim: int) -> bool:
        key = (dtype, group, head_dim)
        if key not in self._vectorised:
            path = self.kernel.code_path(dtype, group, head_dim)
            self._vectorised[key] = path != "portable"
            log.info("attention: %s for %s, %d query heads per KV head, head_dim %d", "native kernel, "
                     f"{path} path" if path != "portable" else "torch reference (the native kernel has "
                     "only its portable loop for this shape on this CPU)", dtype, group, head_dim)
        return self._vectorised[key]
