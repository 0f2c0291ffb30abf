"""What this CPU computes natively (from /proc/cpuinfo), the CONVEYOR_CPU_ISA cap, and the dtype
that `--dtype auto` picks from them. Read by the supervisor only: workers get the outcome in the
EngineConfig (the dtype and the KV cache's, the cap for the kernel's compile flags) and the cap
for torch in their environment, before torch is imported."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from proto.config import CPU_ISAS, EngineConfig
from proto.errors import ValidationError

CAP_VARIABLE = "CONVEYOR_CPU_ISA"
# Each level needs its own flags and every level below it.
LEVEL_FLAGS = {
    "baseline": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_bf16": frozenset({"avx512_bf16"}),
    "amx": frozenset({"amx_bf16", "amx_tile"}),
}
# How torch is held to a level: oneDNN's matmuls and ATen's vectorised kernels.
_ONEDNN_ISA = {"baseline": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE",
               "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX"}
_ATEN_CAPABILITY = {"baseline": "default", "avx2": "avx2", "avx512": "avx512",
                    "avx512_bf16": "avx512", "amx": "avx512"}


@dataclass(frozen=True)
class CpuIsa:
    """detected: the highest level this CPU has; level: the one conveyor uses (detected, or a
    lower cap). ne_convert: AVX-NE-CONVERT, native bf16 conversion on CPUs without AVX-512."""

    detected: str
    level: str
    ne_convert: bool = False

    @property
    def capped(self) -> bool:
        return self.level != self.detected

    @property
    def bf16_native(self) -> bool:
        """bf16 matmuls run in hardware (AMX, AVX512-BF16, or AVX-NE-CONVERT when not capped)."""
        return rank(self.level) >= rank("avx512_bf16") or (self.ne_convert and not self.capped)


def torch_isa_env(cap: str) -> dict[str, str]:
    """Environment that holds a CPU worker's torch to cap (EngineConfig.cpu_isa); {} when ''."""
    if not cap:
        return {}
    return {"ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[cap], "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY[cap]}


def rank(level: str) -> int:
    return CPU_ISAS.index(level)


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags; empty where /proc/cpuinfo has none (not Linux on x86)."""
    try:
        with cpuinfo.open() as lines:
            flags = next((line for line in lines if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(flags.partition(":")[2].split())


def detect_level(flags: frozenset[str]) -> str:
    level = "baseline"
    for name in CPU_ISAS[1:]:
        if not LEVEL_FLAGS[name] <= flags:
            break
        level = name
    return level


def cpu_isa(flags: frozenset[str], cap: str = "") -> CpuIsa:
    """This CPU's levels under cap ('' = none; a cap above what the CPU has changes nothing)."""
    if cap and cap not in CPU_ISAS:
        raise ValidationError(f"{CAP_VARIABLE} / --cpu-isa must be one of {', '.join(CPU_ISAS)}, "
                              f"got {cap!r}", "cpu_isa")
    detected = detect_level(flags)
    level = cap if cap and rank(cap) < rank(detected) else detected
    return CpuIsa(detected, level, "avx_ne_convert" in flags and "avx2" in flags)


def choose_dtype(requested: str, isa: CpuIsa, on_gpu: bool,
                 gpu_capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """(dtype, why): the decision table of --dtype. auto is bf16 where bf16 runs natively (a CPU
    with it, a CUDA GPU of compute capability 8.0 or later, or one whose capability is unknown),
    fp32 otherwise; an explicit bfloat16 on a CPU without it still runs (bf16 storage, emulated
    matmuls) and the reason says so."""
    if on_gpu:
        if requested == "auto" and gpu_capability is not None and gpu_capability < (8, 0):
            return "float32", (f"auto: CUDA GPU of compute capability {gpu_capability[0]}.{gpu_capability[1]} "
                               "has no native bf16 (it needs 8.0, Ampere or later)")
        return ("bfloat16" if requested == "auto" else requested), f"{requested}: CUDA GPU"
    where = f"CPU ISA {isa.level}" + (f" (capped from {isa.detected})" if isa.capped else "")
    if requested == "auto":
        if isa.bf16_native:
            return "bfloat16", f"auto: {where} computes bf16 natively"
        return "float32", (f"auto: {where} has no native bf16 (needs AMX, AVX512-BF16 or "
                           "AVX-NE-CONVERT), so float32 is the fast choice")
    if requested == "bfloat16" and not isa.bf16_native:
        return "bfloat16", (f"bfloat16 as asked, but {where} has no native bf16: weights and KV cache "
                            "are stored in bf16 and matmuls are emulated, several times slower than "
                            "--dtype float32 here")
    return requested, f"{requested} as asked ({where})"


def choose_kv_cache_dtype(requested: str, requested_dtype: str, dtype: str, isa: CpuIsa,
                          on_gpu: bool, attention_backend: str = "auto") -> tuple[str, str]:
    """(kv_cache_dtype, why, '' when it is simply the model's): the decision table of
    --kv-cache-dtype. auto is the model's dtype, except where `--dtype auto` chose float32 on a CPU
    for want of native bf16 matmuls: there the cache is bf16, since attention only loads and
    multiplies what it reads (the native kernel's AVX2 mixed path widens bf16 K/V as it loads them
    and computes in fp32), and half the
    bytes per token is twice the context in --kv-cache-memory and half the reads of a decode
    (docs/benchmarks.md "A bf16 KV cache under an fp32 model"). An explicit --dtype float32 keeps
    an fp32 cache: that run matches Hugging Face exactly, and so does --attention-backend torch (the
    reference is what the other backends are held to)."""
    if requested != "auto":
        return requested, "" if requested == dtype else f"KV cache {requested} as asked"
    if (requested_dtype == "auto" and dtype == "float32" and not on_gpu and rank(isa.level) >= rank("avx2")
            and attention_backend in ("auto", "native")):
        return "bfloat16", ("KV cache auto: bfloat16, half of float32's memory and reads per token "
                            "(attention widens it to fp32 as it reads; --kv-cache-dtype float32 keeps fp32)")
    return dtype, ""


def resolve_dtype(config: EngineConfig, on_gpu: bool, environ: Mapping[str, str],
                  flags: frozenset[str] | None = None, gpu_capability: tuple[int, int] | None = None) -> EngineConfig:
    """config with dtype and kv_cache_dtype resolved (never auto), dtype_reason set (the KV
    cache's reason after the model's, when it is not simply the model's dtype) and cpu_isa the
    effective cap ('' when uncapped): the cap is config.cpu_isa, else $CONVEYOR_CPU_ISA."""
    isa = cpu_isa(read_cpu_flags() if flags is None else flags,
                  config.cpu_isa or environ.get(CAP_VARIABLE, "").strip())
    dtype, reason = choose_dtype(config.dtype, isa, on_gpu, gpu_capability)
    kv_dtype, kv_reason = choose_kv_cache_dtype(config.kv_cache_dtype, config.dtype, dtype, isa, on_gpu,
                                                config.attention_backend)
    return config.with_updates(dtype=dtype, kv_cache_dtype=kv_dtype,
                               dtype_reason="; ".join(filter(None, (reason, kv_reason))),
                               cpu_isa=isa.level if isa.capped else "")
