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

import logging
from collections.abc import Callable

import torch

from worker_proc.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from worker_proc.kv_cache import KVLayout

log = logging.getLogger(__name__)

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


class VarlenPagedAttention:
    """One varlen kernel call per layer for the whole step; same results as the reference."""

    kv_layout = KVLayout.BLOCKS_MAJOR  # flash-attn's paged K/V: [num_blocks, block_size, kv_heads, dim]

    def __init__(self, kernel: VarlenKernel, block_size: int) -> None:
        self.kernel = kernel
        self.block_size = block_size
        self.paged = block_size % PAGED_BLOCK_MULTIPLE == 0

    @property
    def needs_packed_context(self) -> bool:
        return not self.paged

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
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


def attention_backend_for(device: torch.device, dtype: torch.dtype, block_size: int) -> AttentionBackend:
    """The fast path on CUDA in bf16/fp16 when flash-attn is installed; the torch reference
    everywhere else (on CUDA it runs SDPA's own fused kernels over the gathered blocks)."""
    half = dtype in (torch.bfloat16, torch.float16)
    kernel = load_flash_kernel() if device.type == "cuda" and half else None
    if kernel is None:
        if device.type == "cuda":
            log.info("flash-attn is not installed: using the torch SDPA reference attention")
        return TorchPagedAttention()
    log.info("attention: flash-attn varlen (%s)", "paged" if block_size % PAGED_BLOCK_MULTIPLE == 0
             else f"gathered {block_size}-token blocks")
    return VarlenPagedAttention(kernel, block_size)
