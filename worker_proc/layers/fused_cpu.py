"""The elementwise steps of a decoder layer as one native pass each (worker_proc/csrc/fused_ops.c),
fp32 or bf16 on AVX2 + FMA or better: the residual add with RMSNorm, silu(gate) * up, and the
rotary embedding of q and k in place. bf16 results round where torch's bf16 kernels round, so they
are torch's own.

torch runs each as two to four kernels with a temporary between them; a 2048-token prefill step
of SmolLM2-135M spent about 0.5 s in them in fp32 (8% of the step) and 0.17 s in bf16 on an AMX
machine (27% of the step). SmolLM2-135M: docs/benchmarks.md "Fused elementwise steps".
"""

from __future__ import annotations

import ctypes
import logging

import torch

from worker_proc.attention.native_kernel import thread_count, vectorised_library

log = logging.getLogger(__name__)

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the C functions' names end so


class FusedCpuOps:
    """Calls release the GIL. Checks what C cannot: dtypes, layouts and shapes."""

    def __init__(self, library: ctypes.CDLL, num_threads_cap: int | None, dtype: torch.dtype = torch.float32) -> None:
        """dtype: what every tensor passed in must be, float32 or bfloat16 (the model's)."""
        if dtype not in _SUFFIX:
            raise ValueError(f"fused CPU ops run float32 or bfloat16, not {dtype}")
        suffix, self.dtype, self._name = _SUFFIX[dtype], dtype, str(dtype).removeprefix("torch.")
        self._add_rms_norm = getattr(library, f"add_rms_norm_{suffix}")
        self._add_rms_norm.argtypes = [_P, _P, _P, _P, _I64, _I64, _F32, _I32]
        self._add_rms_norm.restype = None
        self._silu_mul = getattr(library, f"silu_mul_{suffix}")
        self._silu_mul.argtypes = [_P, _P, _I64, _I64, _I32]
        self._silu_mul.restype = None
        self._rotary = getattr(library, f"rotary_{suffix}")
        self._rotary.argtypes = [_P, _I64, _P, _P, _I64, _I64, _I64, _I32]
        self._rotary.restype = None
        self.num_threads_cap = num_threads_cap

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """norm(x) as a new tensor. x: [rows, dim], the ops' dtype (as every tensor below)."""
        return self._norm(x.contiguous(), None, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the sum is written into x's buffer when x is
        contiguous (else into a copy), and returned as the new residual stream."""
        x = x.contiguous()
        return self._norm(x, residual.contiguous(), weight, eps), x

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> torch.Tensor:
        self._check_vector("rms_norm weight", weight, x.shape[-1])
        self._check_rows("rms_norm x", x, weight.shape[0])
        if residual is not None and (residual.dtype != self.dtype or residual.shape != x.shape):
            raise ValueError(f"rms_norm: residual {residual.dtype} {tuple(residual.shape)} is not x's "
                             f"{self._name} {tuple(x.shape)}")
        out = torch.empty_like(x)
        self._add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), x.shape[0], x.shape[1], eps, thread_count(self.num_threads_cap))
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * inter] (gate, then up) -> silu(gate) * up, [rows, inter]."""
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        self._check_rows("silu_mul gate_up", gate_up, width)
        if width % 2:
            raise ValueError(f"silu_mul: gate_up has {width} columns, not two equal halves")
        out = gate_up.new_empty(rows, width // 2)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, thread_count(self.num_threads_cap))
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """Rotate x in place, as layers.rotary.apply_rotary does. x: [tokens, heads, head_dim],
        heads contiguous, token rows any stride apart; cos, signed_sin: [tokens, 1, head_dim]."""
        tokens, heads, head_dim = x.shape
        if x.dtype != self.dtype or x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2:
            raise ValueError(f"rotary needs {self._name} [tokens, heads, head_dim] with heads contiguous and an "
                             f"even head_dim, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
        for name, table in (("cos", cos), ("signed_sin", signed_sin)):
            if table.dtype != self.dtype or table.shape != (tokens, 1, head_dim) or not table.is_contiguous():
                raise ValueError(f"rotary needs a contiguous {self._name} {name} [{tokens}, 1, {head_dim}], got "
                                 f"{table.dtype} {tuple(table.shape)}")
        self._rotary(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), tokens, heads, head_dim,
                     thread_count(self.num_threads_cap))

    def _check_rows(self, name: str, x: torch.Tensor, dim: int) -> None:
        if x.dtype != self.dtype or x.dim() != 2 or not x.is_contiguous() or x.shape[1] != dim:
            raise ValueError(f"{name} must be contiguous {self._name} [rows, {dim}], got {x.dtype} {tuple(x.shape)}")

    def _check_vector(self, name: str, x: torch.Tensor, dim: int) -> None:
        if x.dtype != self.dtype or x.shape != (dim,) or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous {self._name} [{dim}], got {x.dtype} {tuple(x.shape)}")


def fused_cpu_ops_for(dtype: torch.dtype, cpu_isa: str) -> FusedCpuOps | None:
    """The native passes when they serve this dtype on this CPU (fp32 or bf16, built with AVX2 + FMA
    under the ISA cap), else None with the reason logged: the layers then run torch's kernels."""
    found = vectorised_library(dtype, (torch.float32, torch.bfloat16), cpu_isa, "fused_ops_vectorised")
    if isinstance(found, str):
        log.info("norms, rotary, silu: torch (%s)", found)
        return None
    log.info("norms, rotary, silu: one native pass each (%s)", str(dtype).removeprefix("torch."))
    return FusedCpuOps(*found, dtype)
