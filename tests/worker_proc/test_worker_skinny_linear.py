"""The native skinny linear (the linears of decode steps, and of every step where AVX2 is the widest
fp32 path) equals F.linear at every ISA level this CPU can run that has it (fp32; bf16 in
test_worker_skinny_bf16.py), for every row count's
block split (the packed-rows path above 64 rows too), ragged shapes (a partial last panel, several
k blocks), a bias and strided rows; a model packed with it serves decode steps through it and
larger ones through oneDNN, or all of them through it where it serves all rows, its LM head every
step; bad input is an error naming it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from native_levels import LEVEL_IDS, MACHINE, VECTOR_LEVELS, vectorised_or_skip
from worker_plans import tiny_engine_config

from deploy.cpu_isa import rank
from worker_proc.attention import native_kernel
from worker_proc.layers import skinny
from worker_proc.runner import ModelRunner


def kernel_for(level: str) -> skinny.SkinnyLinear:
    return skinny.SkinnyLinear(*vectorised_or_skip(level, "skinny_linear_supported"))


@pytest.fixture(scope="module", params=VECTOR_LEVELS, ids=LEVEL_IDS)
def kernel(request: pytest.FixtureRequest) -> skinny.SkinnyLinear:
    return kernel_for(request.param)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 37, 130, 257, 302, 611])
@pytest.mark.parametrize("out_features,in_features", [(7, 13), (20, 64), (960, 576), (3, 8), (1, 1), (33, 600)])
def test_equals_f_linear_for_every_row_count_and_ragged_shape(kernel: skinny.SkinnyLinear, rows: int,
                                                              out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    expected = F.linear(x.double(), weight.double()).float()
    torch.testing.assert_close(kernel.pack(weight)(x, None), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5, 300], ids=["two panels a tile", "two rows, two panels a tile",
                                                   "panels split", "rows packed"])
def test_a_bias_is_added_and_rows_may_lie_apart(kernel: skinny.SkinnyLinear, rows: int) -> None:
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(rows, 100, generator=generator)
    x = wide[:, 10:74]  # rows 100 elements apart, 64 used
    weight, bias = torch.randn(40, 64, generator=generator), torch.randn(40, generator=generator)
    expected = F.linear(x.double(), weight.double(), bias.double()).float()
    torch.testing.assert_close(kernel.pack(weight)(x, bias), expected, rtol=1e-5, atol=1e-4)


def test_packed_rows_take_inputs_in_several_blocks(kernel: skinny.SkinnyLinear) -> None:
    generator = torch.Generator().manual_seed(5)  # 3100 inputs: blocks of 1536, 1536 and 28
    x, weight = torch.randn(270, 3100, generator=generator), torch.randn(24, 3100, generator=generator)
    bias = torch.randn(24, generator=generator)
    expected = F.linear(x.double(), weight.double(), bias.double()).float()
    torch.testing.assert_close(kernel.pack(weight)(x, bias), expected, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("rows", [64, 1000], ids=["panels split", "rows packed"])
def test_the_threads_claiming_work_do_not_change_a_bit_of_the_result(kernel: skinny.SkinnyLinear,
                                                                      rows: int) -> None:
    generator = torch.Generator().manual_seed(7)  # 1000 rows: 11 blocks of 90-96 for one thread, 12 of 78-84 for 2-3
    x, weight = torch.randn(rows, 576, generator=generator), torch.randn(200, 576, generator=generator)
    packed, previous = kernel.pack(weight), torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(packed(x, None))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.parametrize("inputs", [600, 3100], ids=["one block of inputs", "blocks of 1536, 1536 and 28"])
def test_a_row_gets_the_same_bits_alone_and_in_a_step_of_any_size(kernel: skinny.SkinnyLinear, inputs: int) -> None:
    """A row's output does not depend on the rows beside it, nor on the tile it lands in (7 rows run
    as tiles of 3 + 4, 13 as 4 + 4 + 5, 11 as 5 + 6), nor on whether its step packs its rows (more
    than 64): both paths sum over the same blocks of inputs."""
    generator = torch.Generator().manual_seed(11)
    x, weight = torch.randn(300, inputs, generator=generator), torch.randn(40, inputs, generator=generator)
    packed = kernel.pack(weight)
    alone = torch.cat([packed(x[i:i + 1], None) for i in range(300)])
    for rows in (2, 7, 8, 9, 11, 13, 33, 64, 65, 100, 300):
        assert torch.equal(packed(x[:rows], None), alone[:rows]), rows
    assert torch.equal(packed(x[200:], None), alone[200:])


def test_bad_input_is_an_error_that_names_it(kernel: skinny.SkinnyLinear) -> None:
    packed = kernel.pack(torch.randn(8, 16))
    with pytest.raises(ValueError, match="fp32 x"):
        packed(torch.randn(2, 16, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match=r"fp32 x \[m, 16\] and contiguous fp32 \(or bf16, pack_wide_panels\) "
                                         r"panels \[1, 16, 16\] of a weight \[8, 16\], got x torch.float32 \(2, 12\)"):
        packed(torch.randn(2, 12), None)
    with pytest.raises(ValueError, match=r"bias \[8\]"):
        packed(torch.randn(2, 16), torch.randn(9))
    with pytest.raises(ValueError, match=r"fp32 weight \[n, k\]"):
        kernel.pack(torch.randn(8, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 5, 6, 64, 256, 257, 611])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (33, 600), (7, 13), (24, 3100)])
def test_a_weight_bf16_holds_exactly_is_kept_as_bf16_and_gives_the_same_bits(
        kernel: skinny.SkinnyLinear, rows: int, out_features: int, in_features: int) -> None:
    """A bf16 checkpoint served in fp32: the kernel keeps the weight's panels in bf16, half the
    bytes, and widening them as they load changes no bit of the product, bias and strided rows too."""
    generator = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16().float()
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features + 5, generator=generator)[:, 3:3 + in_features]  # rows apart
    kept = kernel.pack(weight)
    assert kept.widened and kept.panels.dtype == torch.bfloat16
    as_fp32 = skinny.SkinnyWeight(kernel, skinny.pack_panels(weight), out_features)
    assert kept.panels.nbytes * 2 == as_fp32.panels.nbytes
    assert torch.equal(kept(x, bias), as_fp32(x, bias))
    torch.testing.assert_close(kept(x, None), F.linear(x.double(), weight.double()).float(), rtol=1e-5, atol=1e-3)


def test_a_weight_bf16_cannot_hold_keeps_fp32_panels(kernel: skinny.SkinnyLinear) -> None:
    weight = torch.randn(40, 64).bfloat16().float()
    weight[3, 5] += 2.0 ** -20  # one value between two bf16 values
    kept = kernel.pack(weight)
    assert not kept.widened and kept.panels.dtype == torch.float32
    x = torch.randn(9, 64)
    torch.testing.assert_close(kept(x, None), F.linear(x.double(), weight.double()).float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("x", [torch.randn(16, 3).t(), torch.randn(16, 1).t(), torch.randn(1, 40)[:, 8:24]],
                         ids=["columns", "a lone row of stride 1", "a lone row of a wider one"])
def test_any_layout_of_x_gives_the_same_result(kernel: skinny.SkinnyLinear, x: torch.Tensor) -> None:
    weight = torch.randn(8, 16)
    torch.testing.assert_close(kernel.pack(weight)(x, None), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_fp32_on_a_cpu_with_avx2_gets_the_kernel(caplog: pytest.LogCaptureFixture) -> None:
    assert skinny.skinny_linear_for(torch.float16, "") is None
    try:
        native_kernel.load_native_library("baseline")
    except native_kernel.NativeBuildError as error:
        pytest.skip(f"the native library does not build here: {error}")
    with caplog.at_level(logging.INFO, logger=skinny.log.name):
        assert skinny.skinny_linear_for(torch.float32, "baseline") is None
    assert "built without AVX2 + FMA" in caplog.text
    if "avx2" in VECTOR_LEVELS:
        assert skinny.skinny_linear_for(torch.float32, "avx2") is not None


@pytest.mark.parametrize("level", VECTOR_LEVELS, ids=LEVEL_IDS)
def test_the_kernel_serves_every_step_only_where_avx2_is_the_widest_fp32_path(level: str) -> None:
    widest = MACHINE.detected if level == "" else level
    assert kernel_for(level).all_rows == (rank(widest) < rank("avx512"))


def test_a_packed_model_runs_decode_steps_through_the_kernel_and_larger_ones_where_it_is_fastest(
        tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    all_rows = kernel_for("").all_rows
    config = tiny_engine_config(tiny_model_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    runner = ModelRunner(config, rank=0, show_progress=False)
    layer, weight = runner.model.model.layers[0].mlp.down_proj, plain.model.layers[0].mlp.down_proj.weight.detach()
    lm_head, table = runner.model.lm_head, plain.lm_head.weight.detach()
    assert layer.skinny is not None and layer.weight.numel() == 0
    assert (layer.packed_weight is None) == all_rows  # no oneDNN copy where the kernel serves all rows
    assert lm_head.skinny is not None and lm_head.packed_weight is None
    calls = []
    real = skinny.SkinnyWeight.__call__
    monkeypatch.setattr(skinny.SkinnyWeight, "__call__", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    for rows in (1, skinny.MAX_ROWS, skinny.MAX_ROWS + 1, 300):
        x = torch.randn(rows, weight.shape[1])
        torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    assert calls == ([1, skinny.MAX_ROWS, skinny.MAX_ROWS + 1, 300] if all_rows else [1, skinny.MAX_ROWS])
    hidden = torch.randn(300, table.shape[1])
    torch.testing.assert_close(lm_head.compute_logits(hidden), F.linear(hidden, table), rtol=1e-4, atol=1e-4)
    assert calls[-1] == 300
