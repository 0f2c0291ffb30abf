"""Rotary position embedding (HF "rotate_half" layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, rope_theta: float, rope_scaling: dict) -> torch.Tensor:
    """float32 [head_dim // 2], computed exactly as HF does so fp32 logits match bit for bit."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}")
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope_scaling)
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short kept, the band between interpolated."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin are computed once per step from the positions and shared by every layer."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict) -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, rope_theta, rope_scaling)  # float32 [head_dim // 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [num_tokens] -> cos, signed_sin: dtype [num_tokens, 1, head_dim] (broadcast over
        heads). signed_sin = [-sin, sin] over the two halves, so rotate_half becomes a flip."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return (torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype),
                torch.cat((-sin, sin), dim=-1).unsqueeze(1).to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] -> same shape, rotated by each token's position.

    HF's x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == swap_halves(x) * signed_sin:
    three kernels instead of seven (this runs once per layer on the decode hot path)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, signed_sin)
