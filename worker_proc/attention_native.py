"""CPU fast path: decodes read K/V straight from the paged cache in a native kernel (native.py).

The reference gathers every decode member's context into a scratch buffer (one copy of K and V)
and then runs batched matmuls whose GQA groups are a few rows tall; the kernel reads each K/V row
once, in place, for the KV head's whole group. Prefill chunks, the cache layout and the cache
writes are the reference's own (this class only replaces TorchPagedAttention.decode).
SmolLM2-135M bf16, 32 decodes at 512 tokens: docs/benchmarks.md "Decode attention on the CPU".
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
