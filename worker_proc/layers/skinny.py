"""The native skinny linear (worker_proc/csrc/skinny_linear.c): y = x W^T for the rows of a decode
step, fp32 on AVX2 + FMA or better, and for every step where AVX2 is the widest fp32 path.

oneDNN's prepacked GEMM runs a decode step (1-64 rows) at a fraction of this machine's peak, and
1-16 rows at a fraction of what streaming the weight allows. The kernel keeps its own copy of W in
panels of 16 output features (pack_panels); the layer's plain weight is dropped. Where the library
was built with AVX-512, oneDNN's packed copy beside it runs steps of more than MAX_ROWS rows; built
for AVX2 (all_rows), the kernel's row-packing path runs them, faster than oneDNN there, and no
oneDNN copy is kept. SmolLM2-135M: docs/benchmarks.md "Decode linears" and "Prompt linears".
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 256  # above this oneDNN's packed GEMM is faster, unless the kernel serves all rows (all_rows)
PANEL = 16  # output features per panel of the packed weight (csrc/skinny_linear.c)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_NO_MEMORY = -3  # csrc/skinny_linear.c: SKINNY_NO_MEMORY


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [ceil(n / PANEL), k, PANEL]: panel p holds output features PANEL * p onwards
    k-major (the last panel's missing features zero), the kernel's weight layout."""
    n, k = weight.shape
    if n % PANEL:
        weight = F.pad(weight, (0, 0, 0, PANEL - n % PANEL))
    return weight.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


class SkinnyLinear:
    """The kernel. Calls release the GIL. Checks what C cannot: dtypes, layouts and shapes."""

    def __init__(self, library: ctypes.CDLL, num_threads_cap: int | None) -> None:
        self._linear = library.skinny_linear_f32
        self._linear.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int]
        self._linear.restype = ctypes.c_int
        self.num_threads_cap = num_threads_cap
        # Built with no fp32 vectors wider than AVX2's: then it serves steps of every size, faster
        # than oneDNN there (docs/benchmarks.md, "Prompt linears"), and layers keep no oneDNN copy.
        self.all_rows = bool(library.skinny_linear_all_rows())

    def pack(self, weight: torch.Tensor) -> SkinnyWeight:
        """weight: fp32 [n, k], the layer's plain weight (not kept)."""
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"skinny linear needs an fp32 weight [n, k], got {weight.dtype} {tuple(weight.shape)}")
        return SkinnyWeight(self, pack_panels(weight.detach()), weight.shape[0])

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x: fp32 [m, k] (rows any stride apart; copied first if a row's elements are not
        contiguous); panels: pack_panels of an fp32 [out_features, k] weight; bias: fp32
        [out_features] or None -> fp32 [m, out_features]."""
        m, k = x.shape
        n = out_features
        num_panels, weight_k = -(-n // PANEL), panels.shape[1] if panels.dim() == 3 else -1
        if x.dtype != torch.float32 or panels.dtype != torch.float32 or not panels.is_contiguous() \
                or panels.shape != (num_panels, weight_k, PANEL) or k != weight_k:
            raise ValueError(f"skinny linear needs fp32 x [m, {weight_k}] and contiguous fp32 panels "
                             f"[{num_panels}, {weight_k}, {PANEL}] of a weight [{n}, {weight_k}], got x "
                             f"{x.dtype} {tuple(x.shape)} and panels {panels.dtype} {tuple(panels.shape)}")
        if x.stride(1) != 1 or (m > 1 and x.stride(0) < k):
            x = x.contiguous()
        if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"skinny linear needs a contiguous fp32 bias [{n}], got {bias.dtype} {tuple(bias.shape)}")
        out = x.new_empty(m, n)
        num_threads = torch.get_num_threads()
        if self.num_threads_cap is not None:
            num_threads = min(num_threads, self.num_threads_cap)
        row_stride = x.stride(0) if m > 1 else k  # a lone row's stride is never used
        status = self._linear(x.data_ptr(), row_stride, panels.data_ptr(),
                              None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k, num_threads)
        if status == _NO_MEMORY:
            raise MemoryError(f"skinny linear: no memory for its row buffers (x {tuple(x.shape)})")
        if status != 0:
            raise ValueError(f"skinny linear refused x {tuple(x.shape)} and panels {tuple(panels.shape)} "
                             f"(status {status})")
        return out


class SkinnyWeight:
    """One layer's weight in the kernel's panel layout, and the kernel: x -> x W^T (+ bias)."""

    def __init__(self, kernel: SkinnyLinear, panels: torch.Tensor, out_features: int) -> None:
        self.kernel = kernel
        self.panels = panels
        self.out_features = out_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x, self.panels, self.out_features, bias)


def skinny_linear_for(dtype: torch.dtype, cpu_isa: str) -> SkinnyLinear | None:
    """The kernel when it serves this dtype on this CPU (fp32, built with AVX2 + FMA under the ISA
    cap), else None with the reason logged: the layers then run oneDNN alone."""
    from worker_proc.attention.native_kernel import vectorised_fp32_library

    found = vectorised_fp32_library(dtype, cpu_isa, "skinny_linear_supported")
    if isinstance(found, str):
        log.info("linears: oneDNN only (%s)", found)
        return None
    kernel = SkinnyLinear(*found)
    if kernel.all_rows:
        log.info("linears: every step through the native skinny linear (no fp32 vectors wider than AVX2's)")
    else:
        log.info("linears: steps of at most %d rows through the native skinny linear, larger ones through "
                 "oneDNN prepacked; the LM head through the skinny linear", MAX_ROWS)
    return kernel
