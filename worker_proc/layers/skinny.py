"""The native skinny linears: y = x W^T for the rows of a decode step, on AVX2 + FMA or better.

fp32 (worker_proc/csrc/skinny_linear.c): oneDNN's prepacked GEMM runs a decode step (1-64 rows) at a
fraction of this machine's peak, and 1-16 rows at a fraction of what streaming the weight allows.
The kernel keeps its own copy of W in panels of 16 output features (pack_panels); the layer's plain
weight is dropped. Where every value of W is a bf16 value (a bf16 checkpoint served in fp32, as the
default model's is), the copy is bf16 (pack_wide_panels) and each weight is widened exactly as it
loads: the same products bit for bit, from half the memory and half the bytes a step streams.
Where the library was built with AVX-512, oneDNN's packed copy beside it runs steps of more than
MAX_ROWS rows; built for AVX2 (all_rows), the kernel's row-packing path runs them, faster than
oneDNN there, and no oneDNN copy is kept. SmolLM2-135M: docs/benchmarks.md "Decode linears" and
"Prompt linears".

bf16 (worker_proc/csrc/skinny_bf16.c), on AVX512-BF16 without AMX: the same panels as bf16 pairs
(pack_pairs), one dpbf16 per pair of inputs; steps of up to MAX_ROWS rows, oneDNN's copy the rest.
Where the CPU has AMX, oneDNN's AMX GEMM keeps the bf16 linears (the kernel is not measured against
it). docs/benchmarks.md "Decode linears in bf16".
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F

from worker_proc.attention.native_kernel import thread_count, vectorised_library

log = logging.getLogger(__name__)

MAX_ROWS = 256  # above this oneDNN's packed GEMM is faster, unless the kernel serves all rows (all_rows)
PANEL = 16  # output features per panel of the packed weight (csrc/skinny_linear.c)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the C functions' names end so
_NO_MEMORY = -3  # csrc/skinny_linear.c: SKINNY_NO_MEMORY


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [ceil(n / PANEL), k, PANEL]: panel p holds output features PANEL * p onwards
    k-major (the last panel's missing features zero), the fp32 kernel's weight layout."""
    n, k = weight.shape
    if n % PANEL:
        weight = F.pad(weight, (0, 0, 0, PANEL - n % PANEL))
    return weight.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


# A bf16 panel's features in memory: the kernel widens a panel's 16 bf16 of one input with AVX2's
# unpacklo/unpackhi, which work within each 128-bit half, so features 0-7 sit at 0-3 and 8-11.
WIDE_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def pack_wide_panels(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [n, k] -> bf16 [ceil(n / PANEL), k, PANEL]: pack_panels with each panel's features in
    WIDE_ORDER, the fp32 kernel's layout for bf16 weights (skinny_linear_f32_w16)."""
    return pack_panels(weight)[..., list(WIDE_ORDER)].contiguous()


def holds_bf16_exactly(weight: torch.Tensor) -> bool:
    """Whether every value of an fp32 weight is a bf16 value (what widening a bf16 copy gives back)."""
    return bool(torch.equal(weight.bfloat16().float(), weight))


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] (k even) -> [ceil(n / PANEL), k / 2, PANEL, 2]: pack_panels with each two inputs of a
    feature side by side, the bf16 kernel's weight layout (one pair of inputs of a panel is one
    dpbf16 operand)."""
    n, k = weight.shape
    if n % PANEL:
        weight = F.pad(weight, (0, 0, 0, PANEL - n % PANEL))
    return weight.reshape(-1, PANEL, k // 2, 2).transpose(1, 2).contiguous()


class SkinnyLinear:
    """The kernel of one dtype. Calls release the GIL. Checks what C cannot: dtypes, layouts and shapes."""

    def __init__(self, library: ctypes.CDLL, num_threads_cap: int | None, dtype: torch.dtype = torch.float32) -> None:
        """dtype: float32 (skinny_linear.c) or bfloat16 (skinny_bf16.c), of x, W, bias and y."""
        if dtype not in _SUFFIX:
            raise ValueError(f"the skinny linear runs float32 or bfloat16, not {dtype}")
        self.dtype, self._name = dtype, "fp32" if dtype == torch.float32 else "bf16"
        self._linear = getattr(library, f"skinny_linear_{_SUFFIX[dtype]}")
        # fp32 only: the same product from bf16 panels (pack_wide_panels)
        self._wide = getattr(library, "skinny_linear_f32_w16") if dtype == torch.float32 else None
        for function in filter(None, (self._linear, self._wide)):
            function.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, ctypes.c_int]
            function.restype = ctypes.c_int
        self.num_threads_cap = num_threads_cap
        # fp32 built with no vectors wider than AVX2's: then it serves steps of every size, faster
        # than oneDNN there (docs/benchmarks.md, "Prompt linears"), and layers keep no oneDNN copy.
        self.all_rows = dtype == torch.float32 and bool(library.skinny_linear_all_rows())

    def pack(self, weight: torch.Tensor) -> SkinnyWeight:
        """weight: [n, k] of the kernel's dtype (k even for bf16), the layer's plain weight (not kept).
        An fp32 weight whose values bf16 holds exactly is kept as bf16 (pack_wide_panels)."""
        if weight.dtype != self.dtype or weight.dim() != 2 or (self.dtype == torch.bfloat16 and weight.shape[1] % 2):
            even = " with k even" if self.dtype == torch.bfloat16 else ""
            raise ValueError(f"skinny linear needs an {self._name} weight [n, k]{even}, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        weight = weight.detach()
        if self.dtype == torch.bfloat16:
            return SkinnyWeight(self, pack_pairs(weight), weight.shape[0])
        if holds_bf16_exactly(weight):
            return SkinnyWeight(self, pack_wide_panels(weight.bfloat16()), weight.shape[0])
        return SkinnyWeight(self, pack_panels(weight), weight.shape[0])

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """x: [m, k] (rows any stride apart; copied first if a row's elements are not contiguous);
        panels: pack_panels (fp32) or pack_pairs (bf16) of a weight [out_features, k], or for the
        fp32 kernel pack_wide_panels of its exact bf16 copy; bias: [out_features] or None ->
        [m, out_features], all of the kernel's dtype."""
        m, k = x.shape
        n, name = out_features, self._name
        num_panels = -(-n // PANEL)
        wide = self._wide is not None and panels.dtype == torch.bfloat16
        weight_k = panels.shape[1] * (2 if self.dtype == torch.bfloat16 else 1) if panels.dim() >= 3 else -1
        layout = (num_panels, weight_k, PANEL) if self.dtype == torch.float32 else (num_panels, weight_k // 2, PANEL, 2)
        if x.dtype != self.dtype or (panels.dtype != self.dtype and not wide) or not panels.is_contiguous() \
                or panels.shape != layout or k != weight_k:
            shown = ", ".join(str(d) for d in layout)
            panel_dtypes = f"{name} (or bf16, pack_wide_panels)" if self._wide is not None else name
            raise ValueError(f"skinny linear needs {name} x [m, {weight_k}] and contiguous {panel_dtypes} panels "
                             f"[{shown}] of a weight [{n}, {weight_k}], got x "
                             f"{x.dtype} {tuple(x.shape)} and panels {panels.dtype} {tuple(panels.shape)}")
        if x.stride(1) != 1 or (m > 1 and x.stride(0) < k):
            x = x.contiguous()
        if bias is not None and (bias.dtype != self.dtype or bias.shape != (n,) or not bias.is_contiguous()):
            raise ValueError(f"skinny linear needs a contiguous {name} bias [{n}], got {bias.dtype} {tuple(bias.shape)}")
        out = x.new_empty(m, n)
        num_threads = thread_count(self.num_threads_cap)
        row_stride = x.stride(0) if m > 1 else k  # a lone row's stride is never used
        status = (self._wide if wide else self._linear)(x.data_ptr(), row_stride, panels.data_ptr(),
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

    @property
    def widened(self) -> bool:
        """Whether an fp32 kernel reads this weight from bf16 panels (pack_wide_panels)."""
        return self.kernel.dtype == torch.float32 and self.panels.dtype == torch.bfloat16

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x, self.panels, self.out_features, bias)


def skinny_linear_for(dtype: torch.dtype, cpu_isa: str) -> SkinnyLinear | None:
    """The kernel when it serves this dtype on this CPU under the ISA cap (fp32 built with AVX2 +
    FMA; bf16 built with AVX512-BF16, on a CPU without AMX), else None with the reason logged: the
    layers then run oneDNN alone."""
    from worker_proc.attention import has_matrix_units

    if dtype == torch.bfloat16 and has_matrix_units(cpu_isa):
        log.info("linears: oneDNN only (bf16 on AMX: oneDNN's AMX GEMM)")
        return None
    probe, needs = (("skinny_linear_bf16_supported", "AVX512-BF16") if dtype == torch.bfloat16
                    else ("skinny_linear_supported", "AVX2 + FMA"))
    found = vectorised_library(dtype, tuple(_SUFFIX), cpu_isa, probe, needs)
    if isinstance(found, str):
        log.info("linears: oneDNN only (%s)", found)
        return None
    kernel = SkinnyLinear(*found, dtype)
    if kernel.all_rows:
        log.info("linears: every step through the native skinny linear (no fp32 vectors wider than AVX2's)")
    else:
        log.info("linears: steps of at most %d rows through the native skinny linear (%s), larger ones through "
                 "oneDNN prepacked; the LM head through the skinny linear", MAX_ROWS, kernel._name)
    return kernel
