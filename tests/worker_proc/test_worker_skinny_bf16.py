"""The bf16 skinny linear (the linears of bf16 decode steps on AVX512-BF16 without AMX) equals the
exact product rounded to bf16, within one bf16 step, at every ISA level this CPU can build it at,
for every row grouping, ragged shapes (a lone last panel, a partial one), a bias and strided rows,
bit for bit whatever the thread count; where it serves, a bf16 model runs its decode steps through
it and larger ones through oneDNN, its LM head every step; where it does not, the reason is logged;
bad input is an error naming it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from native_levels import MACHINE
from worker_plans import tiny_engine_config

from deploy.cpu_isa import rank
from worker_proc.attention import has_matrix_units, native_kernel
from worker_proc.layers import skinny
from worker_proc.runner import ModelRunner

# "" = -march=native; the avx512_bf16 cap where the CPU has more (AMX)
BF16_LEVELS = [level for level in ("", "avx512_bf16") if rank(MACHINE.detected) >= rank("avx512_bf16")
               and not has_matrix_units(level)]
needs_bf16 = pytest.mark.skipif(not BF16_LEVELS, reason=f"this CPU ({MACHINE.detected}) has no AVX512-BF16, "
                                                         "or only with AMX (where oneDNN keeps the bf16 linears)")


def bf16_kernel(level: str) -> skinny.SkinnyLinear:
    found = native_kernel.vectorised_library(torch.bfloat16, (torch.bfloat16,), level, "skinny_linear_bf16_supported")
    if isinstance(found, str):
        pytest.skip(found)
    return skinny.SkinnyLinear(*found, torch.bfloat16)


@pytest.fixture(scope="module", params=BF16_LEVELS or [""], ids=[level or "native" for level in BF16_LEVELS or [""]])
def kernel(request: pytest.FixtureRequest) -> skinny.SkinnyLinear:
    if not BF16_LEVELS:
        pytest.skip("no AVX512-BF16 level on this CPU")
    return bf16_kernel(request.param)


def exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


def assert_within_a_bf16_step(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 16, 37, 64, 130, 257])
@pytest.mark.parametrize("out_features,in_features", [(7, 14), (20, 64), (48, 576), (3, 8), (1, 2), (33, 600)])
def test_equals_the_product_rounded_for_every_row_count_and_ragged_shape(kernel: skinny.SkinnyLinear, rows: int,
                                                                         out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    assert_within_a_bf16_step(kernel.pack(weight)(x, None), exact(x, weight))


def test_a_bias_is_added_and_rows_may_lie_apart(kernel: skinny.SkinnyLinear) -> None:
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 100, generator=generator).bfloat16()
    x = wide[:, 10:74]  # rows 100 elements apart, 64 used
    weight = torch.randn(40, 64, generator=generator).bfloat16()
    bias = torch.randn(40, generator=generator).bfloat16()
    assert_within_a_bf16_step(kernel.pack(weight)(x, bias), exact(x, weight, bias))


def test_the_threads_claiming_tiles_do_not_change_a_bit_of_the_result(kernel: skinny.SkinnyLinear) -> None:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(20, 576, generator=generator).bfloat16()
    packed, previous = kernel.pack(torch.randn(200, 576, generator=generator).bfloat16()), torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(packed(x, None))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_bad_input_is_an_error_that_names_it(kernel: skinny.SkinnyLinear) -> None:
    packed = kernel.pack(torch.randn(8, 16).bfloat16())
    with pytest.raises(ValueError, match=r"bf16 x \[m, 16\] and contiguous bf16 panels \[1, 8, 16, 2\]"):
        packed(torch.randn(2, 16), None)
    with pytest.raises(ValueError, match=r"got x torch.bfloat16 \(2, 12\)"):
        packed(torch.randn(2, 12).bfloat16(), None)
    with pytest.raises(ValueError, match=r"bf16 bias \[8\]"):
        packed(torch.randn(2, 16).bfloat16(), torch.randn(8))
    with pytest.raises(ValueError, match=r"bf16 weight \[n, k\] with k even, got torch.bfloat16 \(8, 15\)"):
        kernel.pack(torch.randn(8, 15).bfloat16())


def test_bf16_gets_the_kernel_only_with_avx512_bf16_and_without_amx(caplog: pytest.LogCaptureFixture) -> None:
    try:
        native_kernel.load_native_library("avx2")
    except native_kernel.NativeBuildError as error:
        pytest.skip(f"the native library does not build here: {error}")
    with caplog.at_level(logging.INFO, logger=skinny.log.name):
        assert skinny.skinny_linear_for(torch.bfloat16, "avx2") is None
    assert "built without AVX512-BF16" in caplog.text
    with caplog.at_level(logging.INFO, logger=skinny.log.name):
        found = skinny.skinny_linear_for(torch.bfloat16, "")
    if has_matrix_units(""):
        assert found is None and "bf16 on AMX" in caplog.text
    else:
        assert (found is not None) == (rank(MACHINE.detected) >= rank("avx512_bf16"))
    if BF16_LEVELS:
        assert found is None or (found.dtype == torch.bfloat16 and not found.all_rows)


@needs_bf16
def test_a_bf16_model_runs_decode_steps_through_the_kernel_and_larger_ones_through_onednn(
        tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ModelRunner(tiny_engine_config(tiny_model_dir, dtype="bfloat16", cpu_isa=BF16_LEVELS[-1]), rank=0,
                         show_progress=False)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.bfloat16)
    layer, weight = runner.model.model.layers[0].mlp.down_proj, plain.model.layers[0].mlp.down_proj.weight.detach()
    lm_head, table = runner.model.lm_head, plain.lm_head.weight.detach()
    assert layer.skinny is not None and layer.skinny.kernel.dtype == torch.bfloat16
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # oneDNN's copy for larger steps
    assert lm_head.skinny is not None and lm_head.packed_weight is None
    calls = []
    real = skinny.SkinnyWeight.__call__
    monkeypatch.setattr(skinny.SkinnyWeight, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    for rows in (1, skinny.MAX_ROWS, skinny.MAX_ROWS + 1):
        x = torch.randn(rows, weight.shape[1]).bfloat16()
        assert_within_a_bf16_step(layer(x), exact(x, weight))
    assert calls == [1, skinny.MAX_ROWS]
    hidden = torch.randn(300, table.shape[1]).bfloat16()
    torch.testing.assert_close(lm_head.compute_logits(hidden).double(), exact(hidden, table), rtol=2 ** -7, atol=1e-3)
    assert calls[-1] == 300
