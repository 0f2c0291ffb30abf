"""The native skinny linear (worker_proc/csrc/skinny_linear.c): y = x W^T for the few rows of a
small decode step, fp32 on AVX2 + FMA or better.

oneDNN's prepacked GEMM runs a 2048-row prefill near this machine's peak but 1-16 rows at a
fraction of what streaming the weight allows (a decode step with few sequences, and the tail of
every burst). The kernel reads W in its plain [out, in] layout, so a layer that uses it keeps that
copy beside oneDNN's packed one. SmolLM2-135M: docs/benchmarks.md "Decode linears at few rows".
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

MAX_ROWS = 16  # above this oneDNN's packed GEMM is as fast (docs/benchmarks.md)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class SkinnyLinear:
    """Calls release the GIL. Checks what C cannot: dtypes, layouts and shapes."""

    def __init__(self, library: ctypes.CDLL, num_threads_cap: int | None) -> None:
        self._linear = library.skinny_linear_f32
        self._linear.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int]
        self._linear.restype = ctypes.c_int
        self.num_threads_cap = num_threads_cap

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x: fp32 [m, k] (rows any stride apart; copied first if a row's elements are not
        contiguous); weight: fp32 [n, k] contiguous; bias: fp32 [n] or None -> fp32 [m, n]."""
        m, k = x.shape
        n = weight.shape[0]
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous() \
                or weight.shape[1] != k:
            raise ValueError(f"skinny linear needs fp32 x [m, {k}] and a contiguous fp32 weight [n, {k}], "
                             f"got {x.dtype} {tuple(x.shape)} and {weight.dtype} {tuple(weight.shape)}")
        if x.stride(1) != 1 or (m > 1 and x.stride(0) < k):
            x = x.contiguous()
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"skinny linear needs a contiguous fp32 bias [{n}], got {bias.dtype} {tuple(bias.shape)}")
        out = x.new_empty(m, n)
        num_threads = torch.get_num_threads()
        if self.num_threads_cap is not None:
            num_threads = min(num_threads, self.num_threads_cap)
        row_stride = x.stride(0) if m > 1 else k  # a lone row's stride is never used
        status = self._linear(x.data_ptr(), row_stride, weight.data_ptr(),
                              None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k, num_threads)
        if status != 0:
            raise ValueError(f"skinny linear refused x {tuple(x.shape)} and weight {tuple(weight.shape)} "
                             f"(status {status})")
        return out


def skinny_linear_for(dtype: torch.dtype, cpu_isa: str) -> SkinnyLinear | None:
    """The kernel when it serves this dtype on this CPU (fp32, built with AVX2 + FMA under the ISA
    cap), else None with the reason logged: the layers then run oneDNN alone."""
    from worker_proc.attention.native_kernel import vectorised_fp32_library

    found = vectorised_fp32_library(dtype, cpu_isa, "skinny_linear_supported")
    if isinstance(found, str):
        log.info("linears: oneDNN only (%s)", found)
        return None
    log.info("linears: oneDNN prepacked; steps of at most %d rows through the native skinny linear", MAX_ROWS)
    return SkinnyLinear(*found)
