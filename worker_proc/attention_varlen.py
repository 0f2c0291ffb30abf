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

attention_backend_for picks a worker's backend (--attention-backend): this one, the native CPU
kernel (attention_native) or the torch reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from worker_proc.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from worker_proc.attention_native import NativePagedAttention
from worker_proc.kv_cache import KVLayout
from worker_proc.native import NativeBuildError, load_paged_attention

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

    @property
    def gathers_context(self) -> bool:
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


class AttentionBackendError(RuntimeError):
    """An explicitly chosen --attention-backend cannot run here; the message names it and why."""


def attention_backend_for(device: torch.device, dtype: torch.dtype, block_size: int,
                          choice: str = "auto", cpu_isa: str = "") -> AttentionBackend:
    """choice is EngineConfig.attention_backend. auto: flash-attn on CUDA in bf16/fp16 when it is
    installed, the native kernel on the CPU when it builds, else the torch reference (on CUDA it
    runs SDPA's fused kernels over the gathered blocks), with one log line saying why. An explicit
    flash or native that cannot run here raises AttentionBackendError at worker start-up. cpu_isa:
    the native kernel's ISA cap (EngineConfig.cpu_isa)."""
    if choice == "flash" or (choice == "auto" and device.type == "cuda"):
        return _flash_backend(device, dtype, block_size, explicit=choice == "flash")
    if choice == "native" or (choice == "auto" and device.type == "cpu"):
        return _native_backend(device, block_size, cpu_isa, explicit=choice == "native")
    return TorchPagedAttention()


def _flash_backend(device: torch.device, dtype: torch.dtype, block_size: int,
                   explicit: bool) -> AttentionBackend:
    half = dtype in (torch.bfloat16, torch.float16)
    kernel = load_flash_kernel() if device.type == "cuda" and half else None
    if kernel is None:
        reason = (f"needs a CUDA device, the worker runs on {device.type}" if device.type != "cuda"
                  else f"needs bfloat16 or float16, the model runs in {dtype}" if not half
                  else "flash-attn is not installed")
        if explicit:
            raise AttentionBackendError(f"--attention-backend flash: {reason}")
        if device.type == "cuda":
            log.info("attention: torch SDPA reference (flash-attn %s)", reason)
        return TorchPagedAttention()
    log.info("attention: flash-attn varlen (%s)", "paged" if block_size % PAGED_BLOCK_MULTIPLE == 0
             else f"gathered {block_size}-token blocks")
    return VarlenPagedAttention(kernel, block_size)


def _native_backend(device: torch.device, block_size: int, cpu_isa: str, explicit: bool) -> AttentionBackend:
    if device.type != "cpu":
        raise AttentionBackendError(f"--attention-backend native runs on the CPU only, the worker runs "
                                    f"on {device.type}")
    try:
        kernel = load_paged_attention(cpu_isa)
    except NativeBuildError as error:
        if explicit:
            raise AttentionBackendError(f"--attention-backend native: {error}") from error
        log.info("attention: torch reference (the native kernel is unavailable: %s)",
                 " ".join(str(error).split())[:400])
        return TorchPagedAttention()
    log.info("attention: native paged attention (%s)", kernel.path.name)
    return NativePagedAttention(kernel, block_size, only_vectorised=not explicit)
