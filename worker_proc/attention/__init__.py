"""Attention behind one small interface: the ragged step every backend reads, the backend, the selector.

Backends, one a module: the torch reference (`reference`, CPU and GPU, what CI checks the others
against), the native CPU kernel (`native`, built by `native_build`, called through `native_kernel`)
and flash-attn varlen on a GPU (`flash`). Each builds, once per step, only the metadata its own
forward reads from the common RaggedBatch; the model passes that metadata to every layer unopened.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, is_dataclass, replace
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch

from worker_proc import parallel
from worker_proc.kv_cache import KVLayout
from worker_proc.model_config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RaggedBatch:
    """One step's members flattened into num_tokens rows, in batch order (numpy, on the CPU).

    Invariant: every block table row holds its member's whole context (this step's tokens
    included), so every slot below addresses a block the member owns."""

    block_size: int
    num_computed: np.ndarray  # int64 [num_seqs] tokens already in the cache
    num_scheduled: np.ndarray  # int64 [num_seqs] tokens computed this step
    context_lens: np.ndarray  # int64 [num_seqs] num_computed + num_scheduled
    cu_seqlens_q: np.ndarray  # int64 [num_seqs + 1] each member's first token row
    token_members: np.ndarray  # int64 [num_tokens] each token's member
    positions: np.ndarray  # int64 [num_tokens]
    block_tables: np.ndarray  # int64 [num_seqs, max_blocks_per_seq], padded with block 0

    def slots(self, rows: np.ndarray | int, positions: np.ndarray) -> np.ndarray:
        """int64, shaped like positions: the cache slot of position p of member rows (broadcast)."""
        block_size = self.block_size
        return self.block_tables[rows, positions // block_size] * block_size + positions % block_size

    @cached_property
    def slot_mapping(self) -> np.ndarray:
        """int64 [num_tokens]: where each token's K/V are written before any layer reads them."""
        return self.slots(self.token_members, self.positions)


class AttentionMetadata(Protocol):
    """What a backend built for one step (its own frozen dataclass); shared by all layers."""

    @property
    def slot_mapping(self) -> torch.Tensor:  # int64 [num_tokens]
        ...


def to_device(meta: Any, device: torch.device) -> Any:
    """meta with every tensor in it (nested dataclasses and tuples too) moved to device."""
    if isinstance(meta, torch.Tensor):
        return meta.to(device, non_blocking=True)
    if isinstance(meta, tuple):
        return tuple(to_device(item, device) for item in meta)
    if is_dataclass(meta) and not isinstance(meta, type):
        return replace(meta, **{f.name: to_device(getattr(meta, f.name), device) for f in fields(meta)})
    return meta


class AttentionBackend(Protocol):
    # True when decodes copy each member's context out of the cache (a per-layer scratch of up to
    # max_num_seqs x max_model_len tokens of K and V that the GPU memory budget must leave room for).
    gathers_context: bool
    # How the runner lays out the KV cache for this backend (kv_cache.KVLayout).
    kv_layout: KVLayout
    # True when forward can take q, k, v in the model's dtype over a narrower cache (it stores K/V
    # in the cache's dtype and computes in q's); model.Attention hands it them so on the CPU, and
    # otherwise casts q, k, v to the cache's dtype first and the output back.
    mixed_dtypes: bool

    def build_metadata(self, batch: RaggedBatch) -> Any:
        """This backend's AttentionMetadata for the step, on the CPU."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        k_cache, v_cache: flat views in kv_layout, kv_layout.shape((num_slots,), kv_heads, head_dim);
        meta: what build_metadata returned. Writes this step's k, v into the caches and returns
        [num_tokens, num_heads * head_dim]."""
        ...


@dataclass(frozen=True)
class AttentionShape:
    """One rank's attention heads: with the dtype, what picks a kernel's code path."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def for_rank(cls, model: ModelConfig, tp_size: int) -> AttentionShape:
        return cls(parallel.divide(model.num_heads, tp_size, "num_attention_heads"),
                   parallel.kv_heads_per_rank(model.num_kv_heads, tp_size), model.head_dim)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads


class AttentionBackendError(RuntimeError):
    """An explicitly chosen --attention-backend cannot run here; the message names it and why."""


def attention_backend_for(device: torch.device, dtype: torch.dtype, block_size: int,
                          choice: str = "auto", cpu_isa: str = "",
                          shape: AttentionShape | None = None,
                          model_dtype: torch.dtype | None = None) -> AttentionBackend:
    """choice is EngineConfig.attention_backend. auto: flash-attn on CUDA in bf16/fp16 when it is
    installed, the native kernel on the CPU when it builds and has a vectorised path for dtype and
    shape (None: not checked), else the torch reference (on CUDA it runs SDPA's fused kernels over
    the gathered blocks), with one log line saying why. An explicit flash or native that cannot run
    here raises AttentionBackendError at worker start-up. cpu_isa: the native kernel's ISA cap
    (EngineConfig.cpu_isa). model_dtype: the dtype q arrives in (None: dtype's); an fp32 model over
    a bf16 cache gets the native kernel's mixed path where it runs at the bf16 path's ISA level."""
    # The backends import this module's interface, so the selector imports them when it runs.
    from worker_proc.attention.reference import TorchPagedAttention

    if choice == "flash" or (choice == "auto" and device.type == "cuda"):
        return _flash_backend(device, dtype, block_size, explicit=choice == "flash")
    if choice == "native" or (choice == "auto" and device.type == "cpu"):
        return _native_backend(device, dtype, block_size, cpu_isa, shape, explicit=choice == "native",
                               model_dtype=model_dtype)
    return TorchPagedAttention()


def _flash_backend(device: torch.device, dtype: torch.dtype, block_size: int,
                   explicit: bool) -> AttentionBackend:
    from worker_proc.attention import flash
    from worker_proc.attention.reference import TorchPagedAttention

    half = dtype in (torch.bfloat16, torch.float16)
    kernel = flash.load_flash_kernel() if device.type == "cuda" and half else None
    if kernel is None:
        reason = (f"needs a CUDA device, the worker runs on {device.type}" if device.type != "cuda"
                  else f"needs bfloat16 or float16, attention runs in {dtype} (the KV cache's dtype)" if not half
                  else "flash-attn is not installed")
        if explicit:
            raise AttentionBackendError(f"--attention-backend flash: {reason}")
        if device.type == "cuda":
            log.info("attention: torch SDPA reference (flash-attn %s)", reason)
        return TorchPagedAttention()
    log.info("attention: flash-attn varlen (%s)", "paged" if block_size % flash.PAGED_BLOCK_MULTIPLE == 0
             else f"gathered {block_size}-token blocks")
    return flash.VarlenPagedAttention(kernel, block_size)


def _native_backend(device: torch.device, dtype: torch.dtype, block_size: int, cpu_isa: str,
                    shape: AttentionShape | None, explicit: bool,
                    model_dtype: torch.dtype | None = None) -> AttentionBackend:
    """shape: None when not known. Auto takes only a vectorised path for it (the reference else);
    explicit native runs whatever path there is."""
    from worker_proc.attention.native import BF16_SDPA_MIN_TOKENS, NativePagedAttention
    from worker_proc.attention.native_kernel import NativeBuildError, load_paged_attention
    from worker_proc.attention.reference import TorchPagedAttention

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
    amx_prefills = dtype == torch.bfloat16 and has_matrix_units(cpu_isa)  # SDPA takes bf16 q, no mixing
    mixed = not amx_prefills and mixed_path(kernel, model_dtype, dtype, shape)
    if shape is not None:
        q_dtype = model_dtype if mixed else dtype
        path = kernel.code_path(q_dtype, shape.group, shape.head_dim, dtype)
        if path == "portable" and not explicit:  # slower than the reference
            log.info("attention: torch reference (the native kernel has only its portable loop for %s, "
                     "%d query heads per KV head, head_dim %d on this CPU)", dtype, shape.group,
                     shape.head_dim)
            return TorchPagedAttention()
        log.info("attention: native paged attention (%s, %s path%s; prompt chunks in blocks: %s)",
                 kernel.path.name, path, f", {q_dtype} q and output over the {dtype} cache" if mixed else "",
                 kernel.block_path(q_dtype, shape.group, shape.head_dim, dtype))
    else:
        log.info("attention: native paged attention (%s)", kernel.path.name)
    if mixed:
        return NativePagedAttention(kernel, block_size, mixed_dtypes=True)
    if not amx_prefills:
        return NativePagedAttention(kernel, block_size)
    log.info("attention: bf16 prefill chunks of %d tokens or more through torch SDPA (AMX)", BF16_SDPA_MIN_TOKENS)
    return NativePagedAttention(kernel, block_size, BF16_SDPA_MIN_TOKENS)


def mixed_path(kernel: Any, model_dtype: torch.dtype | None, cache_dtype: torch.dtype,
               shape: AttentionShape | None) -> bool:
    """Whether the kernel (native_kernel.PagedAttentionKernel) should take q in model_dtype over a
    cache_dtype cache itself: an fp32 model over a bf16 cache, where its mixed path runs at the same
    ISA level as its bf16 path for this shape (the AVX2 one, or the portable loop alike; the AVX-512
    bf16 path multiplies bf16 on dpbf16, worth the casts)."""
    if model_dtype != torch.float32 or cache_dtype != torch.bfloat16 or shape is None:
        return False
    return (kernel.code_path(model_dtype, shape.group, shape.head_dim, cache_dtype)
            == kernel.code_path(cache_dtype, shape.group, shape.head_dim))


def has_matrix_units(cpu_isa: str) -> bool:
    """Whether this CPU's AMX tiles are usable (the OS grants them) and the ISA cap allows them:
    there torch's SDPA multiplies bf16 prompt chunks faster than the kernel; without AMX the kernel's
    AVX512-BF16 block path is faster (docs/benchmarks.md "Prefill attention in bf16")."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return cpu_isa in ("", "amx") and probe is not None and bool(probe())
