"""deploy.cpu_isa: each CPU's flags -> ISA level, dtype and reason; the cap and what it tells torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cpu_isa import choose_dtype, choose_kv_cache_dtype, cpu_isa, read_cpu_flags, resolve_dtype, torch_isa_env
from deploy.devices import worker_env
from proto.config import EngineConfig
from proto.errors import ValidationError

ZEN3 = frozenset("sse4_2 avx avx2 fma f16c bmi2".split())
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ZEN4 = SKYLAKE_X | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}
ARROW_LAKE = ZEN3 | {"avx_ne_convert", "avx_vnni"}


@pytest.mark.parametrize("flags, level, dtype, reason", [
    (ZEN3, "avx2", "float32", "no native bf16"),
    (SKYLAKE_X, "avx512", "float32", "no native bf16"),
    (ZEN4, "avx512_bf16", "bfloat16", "computes bf16 natively"),
    (SAPPHIRE_RAPIDS, "amx", "bfloat16", "computes bf16 natively"),
    (ARROW_LAKE, "avx2", "bfloat16", "computes bf16 natively"),
    (frozenset(), "baseline", "float32", "no native bf16"),
])
def test_auto_is_bf16_exactly_where_the_cpu_computes_it_natively(
        flags: frozenset[str], level: str, dtype: str, reason: str) -> None:
    isa = cpu_isa(flags)
    assert isa.level == isa.detected == level
    chosen, why = choose_dtype("auto", isa, on_gpu=False)
    assert chosen == dtype and reason in why and level in why


def test_a_cap_lowers_the_level_and_turns_off_native_bf16() -> None:
    isa = cpu_isa(SAPPHIRE_RAPIDS, "avx2")
    assert (isa.detected, isa.level, isa.capped) == ("amx", "avx2", True)
    dtype, why = choose_dtype("auto", isa, on_gpu=False)
    assert dtype == "float32" and "capped from amx" in why
    assert not cpu_isa(ARROW_LAKE, "baseline").bf16_native  # AVX-NE-CONVERT is above any cap


def test_a_cap_above_the_cpu_changes_nothing_and_an_unknown_one_is_refused() -> None:
    assert cpu_isa(ZEN3, "amx").level == "avx2" and not cpu_isa(ZEN3, "amx").capped
    with pytest.raises(ValidationError, match=r"must be one of baseline, avx2, avx512, avx512_bf16, amx, "
                                              r"got 'sse9'"):
        cpu_isa(ZEN3, "sse9")


def test_explicit_bf16_without_native_bf16_runs_and_says_it_is_emulated() -> None:
    dtype, why = choose_dtype("bfloat16", cpu_isa(ZEN3), on_gpu=False)
    assert dtype == "bfloat16" and "emulated" in why and "--dtype float32" in why
    assert choose_dtype("float32", cpu_isa(ZEN4), on_gpu=False)[0] == "float32"


def test_auto_on_a_gpu_is_bf16_from_ampere_on_and_fp32_before() -> None:
    assert choose_dtype("auto", cpu_isa(ZEN3), on_gpu=True) == ("bfloat16", "auto: CUDA GPU")  # unknown
    assert choose_dtype("auto", cpu_isa(ZEN3), on_gpu=True, gpu_capability=(8, 0))[0] == "bfloat16"
    dtype, why = choose_dtype("auto", cpu_isa(ZEN3), on_gpu=True, gpu_capability=(7, 5))
    assert dtype == "float32" and "compute capability 7.5 has no native bf16" in why
    assert choose_dtype("bfloat16", cpu_isa(ZEN3), on_gpu=True, gpu_capability=(7, 5))[0] == "bfloat16"


def test_the_lowest_compute_capability_is_that_of_the_visible_gpus() -> None:
    from deploy.devices import lowest_compute_capability

    smi = "0, GPU-aaa, 9.0\n1, GPU-bbb, 7.5\n"
    pci_order = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert lowest_compute_capability(["0"], lambda: smi, pci_order) == (9, 0)
    assert lowest_compute_capability(["0"], lambda: smi, {}) == (7, 5)  # CUDA's order may differ: all
    assert lowest_compute_capability(["0", "1"], lambda: smi, pci_order) == (7, 5)
    assert lowest_compute_capability(["GPU-aaa"], lambda: smi, {}) == (9, 0)
    assert lowest_compute_capability(["0"], lambda: "0, GPU-aaa, [N/A]\n", {}) is None

    def missing() -> str:
        raise FileNotFoundError("nvidia-smi")

    assert lowest_compute_capability(["0"], missing) is None


def test_the_cap_reaches_torch_only_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert torch_isa_env("") == {}
    assert torch_isa_env("avx2") == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert worker_env(EngineConfig(cpu_isa="avx512"), 0, []) == {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512", "THP_MEM_ALLOC_ENABLE": "1"}
    assert worker_env(EngineConfig(cpu_isa="avx2"), 0, ["0"]) == {"CUDA_VISIBLE_DEVICES": "0"}


def test_the_supervisor_resolves_auto_and_the_cap_from_the_environment() -> None:
    config = resolve_dtype(EngineConfig(), on_gpu=False, environ={"CONVEYOR_CPU_ISA": "avx512"},
                           flags=SAPPHIRE_RAPIDS)
    assert (config.dtype, config.cpu_isa) == ("float32", "avx512")
    assert "capped from amx" in config.dtype_reason
    uncapped = resolve_dtype(EngineConfig(), on_gpu=False, environ={}, flags=SAPPHIRE_RAPIDS)
    assert (uncapped.dtype, uncapped.cpu_isa) == ("bfloat16", "")
    flag_wins = resolve_dtype(EngineConfig(cpu_isa="avx2"), on_gpu=False,
                              environ={"CONVEYOR_CPU_ISA": "avx512"}, flags=SAPPHIRE_RAPIDS)
    assert flag_wins.cpu_isa == "avx2"


@pytest.mark.parametrize("flags, dtype, kv_cache_dtype, expected", [
    (ZEN3, "auto", "auto", "bfloat16"),  # fp32 for want of bf16 matmuls: a bf16 cache halves its reads
    (SKYLAKE_X, "auto", "auto", "bfloat16"),
    (frozenset(), "auto", "auto", "float32"),  # baseline: no vectorised kernel path reads bf16
    (ZEN3, "float32", "auto", "float32"),  # an explicit float32 run matches Hugging Face exactly
    (ZEN4, "auto", "auto", "bfloat16"),  # the model's own
    (ZEN4, "float32", "auto", "float32"),
    (ZEN3, "auto", "float32", "float32"),
    (ZEN4, "auto", "float32", "float32"),
    (ZEN4, "float32", "bfloat16", "bfloat16"),
])
def test_kv_cache_dtype_auto_is_the_models_except_under_an_auto_float32_cpu_model(
        flags: frozenset[str], dtype: str, kv_cache_dtype: str, expected: str) -> None:
    config = resolve_dtype(EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype), on_gpu=False, environ={},
                           flags=flags)
    assert config.kv_cache_dtype == config.kv_dtype == expected
    assert ("KV cache" in config.dtype_reason) == (expected != config.dtype)


def test_kv_cache_dtype_auto_keeps_fp32_for_the_torch_reference() -> None:
    """The reference would multiply bf16 in emulation on such a CPU; the native kernel widens it."""
    for backend, expected in [("torch", "float32"), ("native", "bfloat16"), ("auto", "bfloat16")]:
        config = resolve_dtype(EngineConfig(attention_backend=backend), on_gpu=False, environ={}, flags=ZEN3)
        assert config.kv_cache_dtype == expected, backend


def test_kv_cache_dtype_auto_on_a_gpu_is_the_models() -> None:
    assert choose_kv_cache_dtype("auto", "auto", "float32", cpu_isa(ZEN3), on_gpu=True) == ("float32", "")
    assert choose_kv_cache_dtype("auto", "auto", "bfloat16", cpu_isa(ZEN3), on_gpu=True) == ("bfloat16", "")
    config = resolve_dtype(EngineConfig(), on_gpu=False, environ={"CONVEYOR_CPU_ISA": "avx2"}, flags=ZEN4)
    assert (config.dtype, config.kv_cache_dtype) == ("float32", "bfloat16")
    assert "capped from avx512_bf16" in config.dtype_reason and "KV cache auto: bfloat16" in config.dtype_reason


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma f16c\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx2", "fma", "f16c"}
    assert read_cpu_flags(tmp_path / "missing") == frozenset()
