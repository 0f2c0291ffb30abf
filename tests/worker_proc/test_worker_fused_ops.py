"""The native elementwise passes (residual add + RMSNorm, silu * up, rotary in place) equal torch's
kernels at every ISA level this CPU can run that has them, on ragged widths and extreme inputs, in
fp32 and in bf16 (rounded where torch rounds); a packed model runs its layers through them; bad
input is an error naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native_levels import LEVEL_IDS, VECTOR_LEVELS, vectorised_or_skip
from worker_plans import tiny_engine_config

from worker_proc.layers import fused_cpu
from worker_proc.layers.rotary import RotaryEmbedding, apply_rotary
from worker_proc.runner import ModelRunner


def ops_for(level: str, dtype: torch.dtype = torch.float32) -> fused_cpu.FusedCpuOps:
    return fused_cpu.FusedCpuOps(*vectorised_or_skip(level, "fused_ops_vectorised", dtype), dtype)


@pytest.fixture(scope="module", params=VECTOR_LEVELS, ids=LEVEL_IDS)
def ops(request: pytest.FixtureRequest) -> fused_cpu.FusedCpuOps:
    return ops_for(request.param)


@pytest.fixture(scope="module", params=VECTOR_LEVELS, ids=LEVEL_IDS)
def bf16_ops(request: pytest.FixtureRequest) -> fused_cpu.FusedCpuOps:
    return ops_for(request.param, torch.bfloat16)


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 13), (33, 64), (3, 8)])
def test_rms_norm_with_and_without_the_residual_add_equals_torch(ops: fused_cpu.FusedCpuOps, rows: int,
                                                                 dim: int) -> None:
    generator = torch.Generator().manual_seed(rows + dim)
    x, residual = torch.randn(rows, dim, generator=generator), torch.randn(rows, dim, generator=generator)
    weight = torch.randn(dim, generator=generator)
    torch.testing.assert_close(ops.rms_norm(x.clone(), weight, 1e-5), F.rms_norm(x, (dim,), weight, 1e-5))
    summed = x.clone()
    normed, stream = ops.add_rms_norm(summed, residual, weight, 1e-6)
    assert stream is summed and torch.equal(summed, x + residual)  # the new residual stream, in x's buffer
    torch.testing.assert_close(normed, F.rms_norm(x + residual, (dim,), weight, 1e-6))
    strided = torch.randn(dim, rows, generator=generator).t()  # (a copy takes the sum)
    expected = strided + residual
    normed, stream = ops.add_rms_norm(strided, residual, weight, 1e-6)
    assert torch.equal(stream, expected)
    torch.testing.assert_close(normed, F.rms_norm(expected, (dim,), weight, 1e-6))


@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 9), (16, 64)])
def test_silu_mul_equals_torch_including_extreme_gates(ops: fused_cpu.FusedCpuOps, rows: int, inter: int) -> None:
    generator = torch.Generator().manual_seed(inter)
    gate_up = 8 * torch.randn(rows, 2 * inter, generator=generator)
    gate_up[0, :6] = torch.tensor([0.0, -100.0, 100.0, -87.0, 88.0, 1e-30])[:min(6, inter)]
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_rotary_in_place_equals_apply_rotary_on_strided_rows(ops: fused_cpu.FusedCpuOps, head_dim: int) -> None:
    tokens = 11
    qkv = torch.randn(tokens, 9 + 2 * 3, head_dim, generator=torch.Generator().manual_seed(head_dim))
    cos, signed_sin = RotaryEmbedding(head_dim, 10000.0, {}).cos_sin(torch.arange(tokens) * 37, torch.float32)
    expected = apply_rotary(qkv[:, :12], cos, signed_sin)
    untouched = qkv[:, 12:].clone()
    ops.rotary_(qkv[:, :12], cos, signed_sin)
    torch.testing.assert_close(qkv[:, :12], expected)
    assert torch.equal(qkv[:, 12:], untouched)  # v is not rotated


@pytest.mark.parametrize("rows,dim", [(512, 576), (7, 13), (3, 8)])
def test_bf16_rms_norm_and_its_residual_add_round_as_torch(bf16_ops: fused_cpu.FusedCpuOps, rows: int,
                                                            dim: int) -> None:
    generator = torch.Generator().manual_seed(rows + dim)
    x, residual = (torch.randn(rows, dim, generator=generator).bfloat16() for _ in range(2))
    weight = (torch.rand(dim, generator=generator) + 0.5).bfloat16()
    summed = x.clone()
    normed, stream = bf16_ops.add_rms_norm(summed, residual, weight, 1e-5)
    want = F.rms_norm(x + residual, (dim,), weight, 1e-5)
    assert stream is summed and torch.equal(summed, x + residual)  # torch's bf16 sum, bit for bit
    # The sum of squares runs in another order than torch's: at most one bf16 unit apart, rarely.
    torch.testing.assert_close(normed, want, rtol=2 ** -7, atol=0)
    assert (normed != want).float().mean() < 1e-3
    plain, want_plain = bf16_ops.rms_norm(x, weight, 1e-5), F.rms_norm(x, (dim,), weight, 1e-5)
    torch.testing.assert_close(plain, want_plain, rtol=2 ** -7, atol=0)
    assert (plain != want_plain).float().mean() < 1e-3


@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 9), (64, 1536)])
def test_bf16_silu_mul_rounds_as_torch(bf16_ops: fused_cpu.FusedCpuOps, rows: int, inter: int) -> None:
    gate_up = (8 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter))).bfloat16()
    gate_up[0, :5] = torch.tensor([0.0, -100.0, 100.0, -87.0, 88.0])[:min(5, inter)].bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    # Equal, but where a gate under -88 leaves torch a denormal and the kernel's exp a tinier one.
    torch.testing.assert_close(bf16_ops.silu_mul(gate_up), F.silu(gate).mul_(up), rtol=0, atol=1e-30)


@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_bf16_rotary_equals_apply_rotary_bit_for_bit(bf16_ops: fused_cpu.FusedCpuOps, head_dim: int) -> None:
    tokens = 300
    qkv = torch.randn(tokens, 9 + 2 * 3, head_dim, generator=torch.Generator().manual_seed(head_dim)).bfloat16()
    cos, signed_sin = RotaryEmbedding(head_dim, 10000.0, {}).cos_sin(torch.arange(tokens) * 7, torch.bfloat16)
    expected = apply_rotary(qkv[:, :12], cos, signed_sin)
    untouched = qkv[:, 12:].clone()
    bf16_ops.rotary_(qkv[:, :12], cos, signed_sin)
    assert torch.equal(qkv[:, :12], expected)
    assert torch.equal(qkv[:, 12:], untouched)


def test_bad_input_is_an_error_that_names_it(ops: fused_cpu.FusedCpuOps) -> None:
    with pytest.raises(ValueError, match=r"rms_norm x must be contiguous float32 \[rows, 8\]"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="rms_norm: residual"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm weight must be contiguous float32 \[8\]"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="two equal halves"):
        ops.silu_mul(torch.randn(2, 7))
    cos = torch.ones(3, 1, 8)
    with pytest.raises(ValueError, match="heads contiguous"):
        ops.rotary_(torch.randn(3, 8, 2).transpose(1, 2), cos, cos)
    with pytest.raises(ValueError, match=r"signed_sin \[3, 1, 8\]"):
        ops.rotary_(torch.randn(3, 2, 8), cos, torch.ones(3, 8))


def test_bf16_ops_refuse_fp32_input_naming_their_dtype(bf16_ops: fused_cpu.FusedCpuOps) -> None:
    with pytest.raises(ValueError, match=r"rms_norm x must be contiguous bfloat16 \[rows, 8\]"):
        bf16_ops.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="rotary needs bfloat16"):
        bf16_ops.rotary_(torch.randn(3, 2, 8), *(torch.ones(3, 1, 8, dtype=torch.bfloat16),) * 2)
    with pytest.raises(ValueError, match="float32 or bfloat16, not torch.float16"):
        fused_cpu.FusedCpuOps(*vectorised_or_skip("", "fused_ops_vectorised"), torch.float16)


def test_fp32_and_bf16_with_avx2_get_them_and_a_packed_model_uses_them(tiny_model_dir) -> None:
    assert fused_cpu.fused_cpu_ops_for(torch.float16, "") is None
    ops_for("")
    assert fused_cpu.fused_cpu_ops_for(torch.bfloat16, "").dtype == torch.bfloat16
    assert fused_cpu.fused_cpu_ops_for(torch.float32, "baseline") is None  # built without AVX2
    runner = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    layer = runner.model.model.layers[0]
    assert isinstance(layer.mlp.fused, fused_cpu.FusedCpuOps)
    assert layer.input_layernorm.fused is layer.self_attn.fused is runner.model.model.norm.fused
