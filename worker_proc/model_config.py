"""The facts the worker needs from an HF config.json, normalised across Llama-family variants."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # EngineConfig.dtype -> torch

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    """EngineConfig.dtype -> torch; 'auto' is the supervisor's to resolve before a worker starts."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one a worker runs in ({', '.join(DTYPES)}): the "
                         "supervisor resolves 'auto' (deploy.cpu_isa.resolve_dtype) before workers start")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # rope_type and its parameters
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    return parse_model_config(json.loads(path.read_text()))


def parse_model_config(raw: dict) -> ModelConfig:
    """Accepts both transformers 5 (`rope_parameters`) and older (`rope_theta` + `rope_scaling`)."""
    model_type = raw.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"only hidden_act 'silu' is supported, got {act!r}")
    _warn_sliding_window(raw)
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    rope_theta, rope_scaling = _rope(raw)
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 hard-codes a q/k/v bias and no o_proj bias; the others follow attention_bias.
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type in ("qwen2", "mistral") else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
    )


def _rope(raw: dict) -> tuple[float, dict]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return float(params["rope_theta"]), scaling
    scaling = dict(raw.get("rope_scaling") or {})
    return float(raw.get("rope_theta", 10000.0)), scaling


def _warn_sliding_window(raw: dict) -> None:
    window = raw.get("sliding_window")
    in_use = raw.get("use_sliding_window", raw.get("model_type") == "mistral")
    if window and in_use:
        log.warning("sliding_window=%s is not implemented: attention is exact only up to %s tokens",
                    window, window)
