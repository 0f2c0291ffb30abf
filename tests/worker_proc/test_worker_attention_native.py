"""The native CPU attention kernel (decodes, prefill chunks) equals the torch reference at every ISA
level this CPU can run, on the path built for that level; backend selection falls back (auto) or
fails at start-up with a reason (an explicit choice). The build itself: test_worker_native_build.py."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from attention_steps import LEVELS, MACHINE, NUM_BLOCKS, load, mixed_plan, prefill_plan, run_step
from worker_plans import tiny_engine_config

from proto.config import EngineConfig
from proto.errors import ValidationError
from proto.messages import StepPlan
from worker_proc.attention import AttentionBackendError, AttentionShape, attention_backend_for
from worker_proc.attention import native_kernel as native
from worker_proc.attention.native import BF16_SDPA_MIN_TOKENS, NativeMetadata, NativePagedAttention
from worker_proc.attention.reference import TorchPagedAttention
from worker_proc.batch import build_step_batch
from worker_proc.runner import ModelRunner

# Each ISA level's path for head_dim 64 (fp32, bf16).
EXPECTED_PATHS = {"baseline": ("portable", "portable"), "avx2": ("avx2", "avx2"),
                  "avx512": ("avx512", "avx2"), "avx512_bf16": ("avx512", "avx512"),
                  "amx": ("avx512", "avx512")}
# The block path of a prefill chunk's queries, fp32 and bf16, head_dim 64.
EXPECTED_BLOCK_PATHS = {"baseline": ("none", "none"), "avx2": ("avx2", "avx2"), "avx512": ("avx512", "avx2"),
                        "avx512_bf16": ("avx512", "avx512"), "amx": ("avx512", "avx512")}


@pytest.fixture(scope="module")
def kernel() -> native.PagedAttentionKernel:
    return load()


@pytest.fixture(scope="module", params=LEVELS, ids=[level or "native" for level in LEVELS])
def leveled(request: pytest.FixtureRequest) -> native.PagedAttentionKernel:
    """The kernel built for each ISA level this CPU has (-march=native included)."""
    return load(request.param)


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """CC names a compiler that does not exist, and nothing is cached yet."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    native.load_native_library.cache_clear()
    yield
    native.load_native_library.cache_clear()


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [
    (2, 2, 64), (6, 2, 64), (16, 2, 64), (8, 1, 128), (16, 1, 32),  # GQA groups 1, 3, 8, 8, 16; vector paths
    (4, 2, 16),  # the tiny model's shape: AVX2 covers it, AVX512 only in fp32
    (3, 3, 8), (6, 2, 24),  # head_dims no vector path covers: the portable loop
])
@pytest.mark.parametrize("block_size", [16, 4])  # tiles inside one block / spanning several
@pytest.mark.parametrize("make_plan_for", [mixed_plan, prefill_plan])
def test_native_attention_equals_the_reference_on_decodes_and_prefill_chunks_at_every_isa_level(
        leveled: native.PagedAttentionKernel, make_plan_for: Callable[[int], StepPlan], block_size: int,
        num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, tolerance: float) -> None:
    plan = make_plan_for(block_size)
    shape = (plan, block_size, dtype, num_heads, num_kv_heads, head_dim)
    want, want_caches = run_step(TorchPagedAttention(), *shape)
    got, got_caches = run_step(NativePagedAttention(leveled, block_size), *shape)
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got_caches, want_caches)  # this step's K/V written to the same slots


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(6, 2, 64), (16, 2, 64), (8, 1, 128), (4, 2, 16),
                                                               (6, 2, 24)])
@pytest.mark.parametrize("make_plan_for", [mixed_plan, prefill_plan])
def test_fp32_q_over_a_bf16_cache_equals_the_reference_mixed_mode_at_every_isa_level(
        leveled: native.PagedAttentionKernel, make_plan_for: Callable[[int], StepPlan], num_heads: int,
        num_kv_heads: int, head_dim: int) -> None:
    """An fp32 model keeping a bf16 cache: the kernel widens K/V exactly and computes everything else
    in fp32, as the reference does (no bf16 rounding of q, probabilities or output)."""
    shape = (make_plan_for(16), 16, torch.float32, num_heads, num_kv_heads, head_dim, torch.bfloat16)
    want, want_caches = run_step(TorchPagedAttention(), *shape)
    got, got_caches = run_step(NativePagedAttention(leveled, 16, mixed_dtypes=True), *shape)
    assert got.dtype == torch.float32 and got_caches.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_caches, want_caches)
    rounded, _ = run_step(NativePagedAttention(leveled, 16), make_plan_for(16), 16, torch.bfloat16, num_heads,
                          num_kv_heads, head_dim)  # the bf16 path, q and output rounded
    assert (got - want).abs().max() < (rounded.float() - want).abs().max() / 10


@pytest.mark.parametrize("level", LEVELS[1:])
def test_an_fp32_model_over_a_bf16_cache_takes_the_mixed_path_where_bf16_runs_at_its_level(level: str) -> None:
    """The mixed path is AVX2's: taken where the bf16 path is AVX2's too, not where AVX-512's
    dpbf16 path is (worth the casts there)."""
    kernel, shape = load(level), AttentionShape(9, 3, 64)
    mixed = kernel.code_path(torch.float32, 3, 64, torch.bfloat16)
    assert mixed == ("portable" if level == "baseline" else "avx2")
    assert kernel.block_path(torch.float32, 3, 64, torch.bfloat16) == ("none" if level == "baseline" else "avx2")
    backend = attention_backend_for(torch.device("cpu"), torch.bfloat16, 16, cpu_isa=level, shape=shape,
                                    model_dtype=torch.float32)
    takes_it = mixed != "portable" and EXPECTED_PATHS[level][1] == mixed
    assert isinstance(backend, NativePagedAttention if level != "baseline" else TorchPagedAttention)
    assert backend.mixed_dtypes == (takes_it or level == "baseline")  # the reference widens too
    same = attention_backend_for(torch.device("cpu"), torch.float32, 16, cpu_isa=level, shape=shape,
                                 model_dtype=torch.float32)
    assert not isinstance(same, NativePagedAttention) or not same.mixed_dtypes  # one dtype: nothing to mix
    with pytest.raises(ValueError, match="no path for torch.bfloat16 q over a torch.float32 cache"):
        kernel.code_path(torch.bfloat16, 3, 64, torch.float32)
    assert kernel.takes_mixed_dtypes
    with pytest.raises(ValueError, match="this build has no dtypes 3"):
        native._checked(kernel._path(3, 3, 64), 3)  # past enum Dtypes: -1, never a path's name
    explicit = attention_backend_for(torch.device("cpu"), torch.bfloat16, 16, "native", level, AttentionShape(6, 2, 24),
                                     torch.float32)  # only the portable loop: its mixed mode, not casts
    assert isinstance(explicit, NativePagedAttention) and explicit.mixed_dtypes


@pytest.mark.parametrize("level", LEVELS[1:])
def test_each_isa_level_runs_the_path_built_for_it(level: str) -> None:
    """A vectorised case must not pass by silently running the portable loop."""
    kernel = load(level)
    fp32, bf16 = EXPECTED_PATHS[level]
    assert kernel.code_path(torch.float32, 3, 64) == fp32
    assert kernel.code_path(torch.bfloat16, 3, 64) == bf16
    assert kernel.code_path(torch.float32, 3, 24) == "portable"  # no vector path has head_dim 24
    assert (kernel.block_path(torch.float32, 3, 64), kernel.block_path(torch.bfloat16, 3, 64)) == \
        EXPECTED_BLOCK_PATHS[level]
    assert kernel.block_path(torch.bfloat16, 17, 64) == "none"  # 17 heads a block of one query: per query
    assert f"-{level}-" in kernel.path.name


def test_the_uncapped_build_runs_the_widest_path_this_cpu_has(kernel: native.PagedAttentionKernel) -> None:
    assert kernel.code_path(torch.float32, 3, 64) == EXPECTED_PATHS[MACHINE.detected][0]
    assert kernel.code_path(torch.bfloat16, 3, 64) == EXPECTED_PATHS[MACHINE.detected][1]
    assert kernel.block_path(torch.bfloat16, 3, 64) == EXPECTED_BLOCK_PATHS[MACHINE.detected][1]


@pytest.mark.parametrize("make_plan_for", [mixed_plan, prefill_plan])
def test_the_kernel_splits_queries_across_threads_without_changing_results(
        kernel: native.PagedAttentionKernel, make_plan_for: Callable[[int], StepPlan]) -> None:
    plan = make_plan_for(16)
    shape = (plan, 16, torch.bfloat16, 6, 2, 64)
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):  # the threads claim (query block, KV head) items as they go
            torch.set_num_threads(threads)
            results.append(run_step(NativePagedAttention(kernel, 16), *shape)[0])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_auto_attends_shapes_without_a_vector_path_with_the_reference(
        kernel: native.PagedAttentionKernel) -> None:
    assert kernel.code_path(torch.float32, 3, 24) == "portable"
    auto = attention_backend_for(torch.device("cpu"), torch.float32, 4, shape=AttentionShape(6, 2, 24))
    assert type(auto) is TorchPagedAttention
    shape = (mixed_plan(4), 4, torch.float32, 6, 2, 24)
    want, _ = run_step(TorchPagedAttention(), *shape)
    forced, _ = run_step(NativePagedAttention(kernel, 4), *shape)  # the portable loop: close, not equal
    assert not torch.equal(forced, want)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("make_plan_for, sdpa_min_tokens, num_by_sdpa, num_by_kernel", [
    (mixed_plan, 6, 2, 6),  # the fresh 7-token prompt and the 6-token chunk; the decodes stay
    (prefill_plan, 20, 3, 2),  # the 40-, 30- and 20-token chunks; the two-token chunk stays
    (prefill_plan, 2, 4, 0),  # every chunk: no kernel call at all
])
def test_long_chunks_through_sdpa_beside_the_kernel_equal_the_reference(
        kernel: native.PagedAttentionKernel, make_plan_for: Callable[[int], StepPlan], sdpa_min_tokens: int,
        num_by_sdpa: int, num_by_kernel: int, dtype: torch.dtype, tolerance: float) -> None:
    backend = NativePagedAttention(kernel, 4, sdpa_min_tokens)
    meta = build_step_batch(make_plan_for(4), 4, NUM_BLOCKS, backend).attn
    assert len(meta.prefills) == num_by_sdpa and len(meta.token_members) == num_by_kernel
    assert meta.kernel_rows is not None and len(meta.kernel_rows) == num_by_kernel
    shape = (make_plan_for(4), 4, dtype, 6, 2, 64)
    want, want_caches = run_step(TorchPagedAttention(), *shape)
    got, got_caches = run_step(backend, *shape)
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got_caches, want_caches)


@pytest.mark.parametrize("amx", [True, False])
def test_auto_sends_long_bf16_chunks_to_sdpa_only_with_amx_and_keeps_fp32_on_the_kernel(
        kernel: native.PagedAttentionKernel, monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    if kernel.code_path(torch.bfloat16, 3, 64) == "portable":
        pytest.skip("no vectorised path on this CPU: auto uses the reference")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    shape = AttentionShape(9, 3, 64)
    bf16 = attention_backend_for(torch.device("cpu"), torch.bfloat16, 16, shape=shape)
    fp32 = attention_backend_for(torch.device("cpu"), torch.float32, 16, shape=shape)
    assert isinstance(bf16, NativePagedAttention) and bf16.sdpa_min_tokens == (BF16_SDPA_MIN_TOKENS if amx else None)
    assert isinstance(fp32, NativePagedAttention) and fp32.sdpa_min_tokens is None
    capped = attention_backend_for(torch.device("cpu"), torch.bfloat16, 16, cpu_isa="avx512_bf16", shape=shape)
    assert isinstance(capped, NativePagedAttention) and capped.sdpa_min_tokens is None  # AMX capped off
    bf16 = NativePagedAttention(kernel, 16, BF16_SDPA_MIN_TOKENS)
    decodes_only = build_step_batch(mixed_plan(16), 16, NUM_BLOCKS, bf16).attn  # no chunk reaches 64
    assert decodes_only.kernel_rows is None and decodes_only.prefills == ()


def test_auto_picks_the_native_kernel_on_the_cpu(kernel: native.PagedAttentionKernel,
                                                 tiny_model_dir: Path) -> None:
    if kernel.code_path(torch.float32, 2, 16) == "portable":  # the tiny model's dtype, group, head_dim
        pytest.skip("no vectorised fp32 path on this CPU (needs AVX2 + FMA): auto uses the reference")
    runner = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    assert isinstance(runner.attention, NativePagedAttention)


def kernel_inputs(meta: NativeMetadata, block_size: int) -> tuple[torch.Tensor, ...]:
    """Random fp32 q, out [num_tokens, 6, 64] and K/V caches [2, NUM_BLOCKS * block_size, 64]."""
    num_tokens = len(meta.token_members)
    q = torch.randn(num_tokens, 6, 64)
    k_cache, v_cache = (torch.randn(2, NUM_BLOCKS * block_size, 64) for _ in range(2))
    return q, torch.empty_like(q), k_cache, v_cache


def short_tables(meta: NativeMetadata) -> NativeMetadata:
    return replace(meta, block_tables=meta.block_tables[:, :1].contiguous())


def block_past_the_cache(meta: NativeMetadata) -> NativeMetadata:
    tables = meta.block_tables.clone()
    tables[6, 4] = NUM_BLOCKS  # member 6 decodes at position 69: its fifth block is read
    return replace(meta, block_tables=tables)


def member_past_the_tables(meta: NativeMetadata) -> NativeMetadata:
    members = meta.token_members.clone()
    members[3] = len(meta.block_tables)
    return replace(meta, token_members=members)


def empty_context(meta: NativeMetadata) -> NativeMetadata:
    lens = meta.token_context_lens.clone()
    lens[8] = 0
    return replace(meta, token_context_lens=lens)


@pytest.mark.parametrize("make_plan_for, corrupt, message", [
    (mixed_plan, short_tables, "token 8 \\(member 2\\): context of 17 tokens needs 2 blocks of 16, its "
                               "block table holds 1"),
    (prefill_plan, short_tables, "token 16 \\(member 0\\): context of 17 tokens needs 2 blocks of 16"),
    (mixed_plan, block_past_the_cache, f"member 6's block table names block {NUM_BLOCKS}, the cache holds "
                                       f"{NUM_BLOCKS} blocks of 16 slots"),
    (mixed_plan, member_past_the_tables, "token 3 \\(member 8\\): member 8 is not one of the step's 8 "
                                         "block tables"),
    (mixed_plan, empty_context, "token 8 \\(member 2\\): context length 0 is < 1"),
])
def test_reads_outside_the_cache_or_tables_are_refused_naming_the_token_or_member(
        kernel: native.PagedAttentionKernel, make_plan_for: Callable[[int], StepPlan],
        corrupt: Callable[[NativeMetadata], NativeMetadata], message: str) -> None:
    meta = corrupt(build_step_batch(make_plan_for(16), 16, NUM_BLOCKS, NativePagedAttention(kernel, 16)).attn)
    q, out, k_cache, v_cache = kernel_inputs(meta, 16)
    out.fill_(7.0)
    with pytest.raises(ValueError, match=message):
        kernel(q, out, k_cache, v_cache, meta.block_tables, meta.token_members, meta.token_context_lens, 16, 1)
    assert bool((out == 7.0).all())  # refused before anything was written


def test_auto_falls_back_to_the_reference_when_the_compiler_is_missing(
        no_compiler: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="worker_proc.attention"):
        backend = attention_backend_for(torch.device("cpu"), torch.bfloat16, 16)
    assert type(backend) is TorchPagedAttention
    assert "native kernel is unavailable" in caplog.text and "no-such-cc" in caplog.text


def test_explicit_native_without_a_compiler_fails_at_start_up_naming_the_option(no_compiler: None) -> None:
    with pytest.raises(AttentionBackendError, match=r"--attention-backend native: .*no-such-cc"):
        attention_backend_for(torch.device("cpu"), torch.bfloat16, 16, "native")


def test_explicit_native_off_the_cpu_and_flash_without_cuda_fail_with_reasons() -> None:
    with pytest.raises(AttentionBackendError, match="native runs on the CPU only"):
        attention_backend_for(torch.device("cuda"), torch.bfloat16, 16, "native")
    with pytest.raises(AttentionBackendError, match="flash: needs a CUDA device"):
        attention_backend_for(torch.device("cpu"), torch.bfloat16, 16, "flash")


def test_explicit_torch_is_the_reference_everywhere() -> None:
    backend = attention_backend_for(torch.device("cpu"), torch.bfloat16, 16, "torch")
    assert type(backend) is TorchPagedAttention


def test_an_unknown_attention_backend_is_refused_with_the_choices() -> None:
    with pytest.raises(ValidationError, match=r"attention_backend must be one of .*'native'.*got 'fast'"):
        EngineConfig(attention_backend="fast")
