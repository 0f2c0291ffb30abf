"""The native elementwise passes (residual add + RMSNorm, silu * up, rotary in place) equal torch's
kernels at every ISA level this CPU can run that has them, on ragged widths and extreme inputs;
a packed fp32 model runs its layers through them; bad input is an error naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native_levels import LEVEL_IDS, VECTOR_LEVELS, vectorised_or_skip
from worker_plans import tiny_engine_config

from worker_proc.layers import fused_cpu
from worker_proc.layers.rotary import RotaryEmbedding, apply_rotary
from worker_proc.runner import ModelRunner


def ops_for(level: str) -> fused_cpu.FusedCpuOps:
    return fused_cpu.FusedCpuOps(*vectorised_or_skip(level, "fused_ops_vectorised"))


@pytest.fixture(scope="module", params=VECTOR_LEVELS, ids=LEVEL_IDS)
def ops(request: pytest.FixtureRequest) -> fused_cpu.FusedCpuOps:
    return ops_for(request.param)


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


def test_bad_input_is_an_error_that_names_it(ops: fused_cpu.FusedCpuOps) -> None:
    with pytest.raises(ValueError, match=r"rms_norm x must be contiguous fp32 \[rows, 8\]"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="rms_norm: residual"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"rms_norm weight must be contiguous fp32 \[8\]"):
        ops.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="two equal halves"):
        ops.silu_mul(torch.randn(2, 7))
    cos = torch.ones(3, 1, 8)
    with pytest.raises(ValueError, match="heads contiguous"):
        ops.rotary_(torch.randn(3, 8, 2).transpose(1, 2), cos, cos)
    with pytest.raises(ValueError, match=r"signed_sin \[3, 1, 8\]"):
        ops.rotary_(torch.randn(3, 2, 8), cos, torch.ones(3, 8))


def test_only_fp32_with_avx2_gets_them_and_a_packed_model_uses_them(tiny_model_dir) -> None:
    assert fused_cpu.fused_cpu_ops_for(torch.bfloat16, "") is None
    ops_for("")
    assert fused_cpu.fused_cpu_ops_for(torch.float32, "baseline") is None  # built without AVX2
    runner = ModelRunner(tiny_engine_config(tiny_model_dir), rank=0, show_progress=False)
    layer = runner.model.model.layers[0]
    assert isinstance(layer.mlp.fused, fused_cpu.FusedCpuOps)
    assert layer.input_layernorm.fused is layer.self_attn.fused is runner.model.model.norm.fused
