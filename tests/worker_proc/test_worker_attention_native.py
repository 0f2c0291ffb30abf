"""The native CPU attention kernel (decodes, prefill chunks) equals the torch reference; its build
is cached per machine; backend selection falls back (auto) or fails at start-up with a reason (an
explicit choice)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from proto.config import EngineConfig
from proto.errors import ValidationError
from proto.messages import StepPlan
from worker_proc import native
from worker_proc.attention import AttentionMetadata, TorchPagedAttention
from worker_proc.attention_native import NativePagedAttention
from worker_proc.attention_varlen import AttentionBackendError, attention_backend_for
from worker_proc.batch import build_step_batch
from worker_proc.runner import ModelRunner

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def kernel() -> native.PagedDecodeKernel:
    try:
        return native.load_paged_decode()
    except native.NativeBuildError as error:
        pytest.skip(f"the native kernel does not build here: {error}")


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """CC names a compiler that does not exist, and nothing is cached yet."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    native.load_paged_decode.cache_clear()
    yield
    native.load_paged_decode.cache_clear()


def mixed_plan(block_size: int) -> StepPlan:
    """A fresh prefill, a chunk continuing mid-prompt, and decodes whose contexts (1 to 70 tokens)
    end inside, exactly at and past block boundaries."""
    pool = BlockPool(NUM_BLOCKS, block_size=block_size)
    decodes = [Seq(f"d{n}", list(range(n)), num_computed=n - 1) for n in (1, 17, 16, 33, 70, 5)]
    seqs = [Seq("fresh", list(range(7))), *decodes[:3], Seq("chunk", list(range(30)), num_computed=9),
            *decodes[3:]]
    return make_plan(seqs, [7, 1, 1, 1, 6, 1, 1, 1], pool)


def prefill_plan(block_size: int) -> StepPlan:
    """Prefill chunks only: a fresh prompt over several blocks, chunks continuing a cached prefix from
    inside a block and from exactly a block boundary, and a two-token chunk ending a prompt."""
    pool = BlockPool(NUM_BLOCKS, block_size=block_size)
    seqs = [Seq("fresh", list(range(40))), Seq("mid", list(range(60)), num_computed=13),
            Seq("boundary", list(range(50)), num_computed=16), Seq("pair", list(range(9)), num_computed=7)]
    return make_plan(seqs, [40, 30, 20, 2], pool)


def run_step(backend: TorchPagedAttention, plan: StepPlan, block_size: int, dtype: torch.dtype,
             num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's attention over random caches; q, k, v are views of one qkv row as the model's."""
    meta = build_step_batch(plan, block_size, NUM_BLOCKS).attn
    generator = torch.Generator().manual_seed(0)
    num_slots, num_tokens = NUM_BLOCKS * block_size, len(plan.input_ids)
    k_cache, v_cache = (torch.randn(num_kv_heads, num_slots, head_dim, generator=generator).to(dtype)
                        for _ in range(2))
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    out = backend.forward(q, k, v, k_cache, v_cache, meta)
    return out, torch.stack([k_cache, v_cache])


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [
    (2, 2, 64), (6, 2, 64),  # GQA groups of 1 and 3, the vectorised path
    (3, 3, 8), (6, 2, 24),  # head_dims no vector path covers: the portable loop
])
@pytest.mark.parametrize("block_size", [16, 4])  # tiles inside one block / spanning several
@pytest.mark.parametrize("make_plan_for", [mixed_plan, prefill_plan])
def test_native_attention_equals_the_reference_on_decodes_and_prefill_chunks(
        kernel: native.PagedDecodeKernel, make_plan_for: Callable[[int], StepPlan], block_size: int,
        num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, tolerance: float) -> None:
    plan = make_plan_for(block_size)
    shape = (plan, block_size, dtype, num_heads, num_kv_heads, head_dim)
    want, want_caches = run_step(TorchPagedAttention(), *shape)
    got, got_caches = run_step(NativePagedAttention(kernel, block_size), *shape)
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got_caches, want_caches)  # this step's K/V written to the same slots


@pytest.mark.parametrize("make_plan_for", [mixed_plan, prefill_plan])
def test_the_kernel_splits_queries_across_threads_without_changing_results(
        kernel: native.PagedDecodeKernel, make_plan_for: Callable[[int], StepPlan]) -> None:
    plan = make_plan_for(16)
    shape = (plan, 16, torch.bfloat16, 6, 2, 64)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run_step(NativePagedAttention(kernel, 16), *shape)
        torch.set_num_threads(2)
        two, _ = run_step(NativePagedAttention(kernel, 16), *shape)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_auto_decodes_shapes_without_a_vector_path_with_the_reference(
        kernel: native.PagedDecodeKernel) -> None:
    assert not kernel.vectorised(torch.float32, 3, 24)
    shape = (mixed_plan(4), 4, torch.float32, 6, 2, 24)
    want, _ = run_step(TorchPagedAttention(), *shape)
    got, _ = run_step(NativePagedAttention(kernel, 4, only_vectorised=True), *shape)
    assert torch.equal(got, want)


def test_auto_picks_the_native_kernel_on_the_cpu(kernel: native.PagedDecodeKernel,
                                                 tiny_model_dir: Path) -> None:
    if not kernel.vectorised(torch.float32, 2, 16):  # the tiny model's dtype, GQA group and head_dim
        pytest.skip("no vectorised fp32 path on this CPU (needs AVX512F): auto decodes with the reference")
    runner = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    assert isinstance(runner.attention, NativePagedAttention) and runner.attention.only_vectorised


def decode_inputs(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, ...]:
    """Random fp32 q [num_tokens, 6, 64] and K/V caches [2, NUM_BLOCKS * block_size, 64]."""
    num_tokens = int(meta.cu_seqlens_q[-1])
    q = torch.randn(num_tokens, 6, 64)
    k_cache, v_cache = (torch.randn(2, NUM_BLOCKS * block_size, 64) for _ in range(2))
    return q, k_cache, v_cache


def short_tables(meta: AttentionMetadata) -> AttentionMetadata:
    return replace(meta, block_tables=meta.block_tables[:, :1].contiguous())


def block_past_the_cache(meta: AttentionMetadata) -> AttentionMetadata:
    tables = meta.block_tables.clone()
    tables[6, 4] = NUM_BLOCKS  # member 6 decodes at position 69: its fifth block is read
    return replace(meta, block_tables=tables)


@pytest.mark.parametrize("corrupt, message", [
    (short_tables, "member 2's context of 17 tokens needs 2 blocks of 16, its block table holds 1"),
    (block_past_the_cache, f"member 6's block table names block {NUM_BLOCKS}, the cache holds "
                           f"{NUM_BLOCKS} blocks of 16 slots"),
])
def test_block_tables_that_would_read_outside_the_cache_are_refused_naming_the_member(
        kernel: native.PagedDecodeKernel, corrupt: Callable[[AttentionMetadata], AttentionMetadata],
        message: str) -> None:
    meta = corrupt(build_step_batch(mixed_plan(16), 16, NUM_BLOCKS).attn)
    with pytest.raises(ValueError, match=message):
        NativePagedAttention(kernel, 16).decode(*decode_inputs(meta, 16), meta)


def test_prefill_tables_that_would_read_outside_the_cache_are_refused_naming_the_query(
        kernel: native.PagedDecodeKernel) -> None:
    meta = short_tables(build_step_batch(prefill_plan(16), 16, NUM_BLOCKS).attn)
    q, k_cache, v_cache = decode_inputs(meta, 16)
    kv = q[:, :2]  # unused: the kernel reads this step's K/V from the cache
    with pytest.raises(ValueError, match="query row 16's context of 17 tokens needs 2 blocks of 16, "
                                         "its block table holds 1"):
        NativePagedAttention(kernel, 16).prefill(q, kv, kv, k_cache, v_cache, meta, torch.empty_like(q))


def test_block_tables_are_checked_once_per_step_not_once_per_layer(
        kernel: native.PagedDecodeKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    checked = []
    check_reads = native.PagedDecodeKernel.check_reads

    def counted(*args: object) -> None:
        checked.append(args)
        check_reads(*args)

    monkeypatch.setattr(native.PagedDecodeKernel, "check_reads", staticmethod(counted))
    backend = NativePagedAttention(kernel, 16)
    steps = [build_step_batch(mixed_plan(16), 16, NUM_BLOCKS).attn for _ in range(2)]
    for meta in steps:
        inputs = decode_inputs(meta, 16)
        for _layer in range(3):
            backend.decode(*inputs, meta)
    assert len(checked) == len(steps)


@pytest.mark.parametrize("context_len, cause", [(0, "context length is < 1"),
                                                (17 * 16, "context runs past its block table")])
def test_a_failed_kernel_call_names_its_cause(kernel: native.PagedDecodeKernel, context_len: int,
                                             cause: str) -> None:
    meta = build_step_batch(mixed_plan(16), 16, NUM_BLOCKS).attn
    q, k_cache, v_cache = decode_inputs(meta, 16)
    context_lens = meta.context_lens.clone()
    context_lens[2] = context_len
    with pytest.raises(RuntimeError, match=cause):  # past the Python checks, as a careless caller would
        kernel(q, torch.empty_like(q), k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, context_lens,
               meta.decode_members, 16, 1, reads_checked=True)


def test_a_built_kernel_is_reused_and_rebuilt_for_another_cpu(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(native, "SOURCE", source)
    cache = tmp_path / "cache"
    try:
        first = native.build(cache)
    except native.NativeBuildError as error:
        pytest.skip(f"no working C compiler: {error}")
    built_at = first.stat().st_mtime_ns
    assert native.build(cache) == first and first.stat().st_mtime_ns == built_at
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : another cpu")
    other = native.build(cache)
    assert other != first and ctypes.CDLL(str(other)).answer() == 42
    assert sorted(cache.iterdir()) == sorted([first, other])  # no partial files left behind


def test_the_build_compiles_the_source_it_hashed_even_if_the_file_changes_meanwhile(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(native, "SOURCE", source)
    try:
        cc = native.compiler()
    except native.NativeBuildError as error:
        pytest.skip(f"no C compiler: {error}")
    checkout = tmp_path / "checkout-cc"  # a compiler during which a checkout rewrites the source
    checkout.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] ||\n"
                        f"  echo 'int answer(void) {{ return 7; }}' > {source}\nexec {cc} \"$@\"\n")
    checkout.chmod(0o755)
    monkeypatch.setenv("CC", str(checkout))
    built = native.build(tmp_path / "cache")
    assert ctypes.CDLL(str(built)).answer() == 42  # cached under the key of the 42 source


def test_a_build_that_hangs_fails_after_the_timeout_naming_the_command(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hanging = tmp_path / "hanging-cc"
    hanging.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo hanging-cc 1.0; exit 0; }\nexec sleep 60\n')
    hanging.chmod(0o755)
    monkeypatch.setenv("CC", str(hanging))
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 0.5)
    with pytest.raises(native.NativeBuildError, match=r"took over 0.5 s: .*hanging-cc .*-fopenmp"):
        native.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("name, is_runtime", [
    ("libgomp.so.1", True), ("libgomp-a34b3233.so.1", True), ("libiomp5.so", True), ("libomp.so.5", True),
    ("libomptarget.so", False), ("libgompd.so.1", False), ("libomptarget.rtl.x86_64.so", False),
])
def test_openmp_runtimes_are_told_from_their_sibling_libraries(name: str, is_runtime: bool) -> None:
    assert bool(native._OPENMP_RUNTIME.fullmatch(name)) == is_runtime


def test_a_failed_build_reports_the_compiler_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = tmp_path / "broken.c"
    source.write_text("int broken(void) { return undeclared_name; }\n")
    monkeypatch.setattr(native, "SOURCE", source)
    try:
        native.compiler()
    except native.NativeBuildError as error:
        pytest.skip(f"no C compiler: {error}")
    with pytest.raises(native.NativeBuildError, match="undeclared_name"):
        native.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_auto_falls_back_to_the_reference_when_the_compiler_is_missing(
        no_compiler: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="worker_proc.attention_varlen"):
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
