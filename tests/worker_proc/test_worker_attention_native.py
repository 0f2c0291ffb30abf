"""The native CPU decode kernel equals the torch reference; its build is cached per machine; backend
selection falls back (auto) or fails at start-up with a reason (an explicit choice)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from proto.config import EngineConfig
from proto.errors import ValidationError
from proto.messages import StepPlan
from worker_proc import native
from worker_proc.attention import TorchPagedAttention
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
def test_native_decodes_equal_the_reference_on_a_mixed_step(
        kernel: native.PagedDecodeKernel, block_size: int, num_heads: int, num_kv_heads: int,
        head_dim: int, dtype: torch.dtype, tolerance: float) -> None:
    plan = mixed_plan(block_size)
    shape = (plan, block_size, dtype, num_heads, num_kv_heads, head_dim)
    want, want_caches = run_step(TorchPagedAttention(), *shape)
    got, got_caches = run_step(NativePagedAttention(kernel, block_size), *shape)
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got_caches, want_caches)  # this step's K/V written to the same slots


def test_the_kernel_splits_members_across_threads_without_changing_results(
        kernel: native.PagedDecodeKernel) -> None:
    plan = mixed_plan(16)
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
    runner = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    assert isinstance(runner.attention, NativePagedAttention)
    assert runner.attention.kernel.vectorised(torch.float32, 2, 16)  # the parity tests' shape


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
