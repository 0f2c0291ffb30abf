"""Model facts the processes must agree on, read from a checkpoint's JSON files (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from proto.config import EngineConfig
from proto.errors import ValidationError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
)


class ModelError(RuntimeError):
    """The model directory cannot be served; the message says what is missing or wrong."""


@dataclass(frozen=True)
class ModelInfo:
    model_dir: Path
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    num_attention_heads: int
    num_key_value_heads: int


def read_model_info(model_dir: Path) -> ModelInfo:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
    config = json.loads(config_path.read_text())
    architectures = config.get("architectures") or []
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ModelError(f"{model_dir}: architectures {architectures} are not supported; "
                         f"conveyor serves {', '.join(SUPPORTED_ARCHITECTURES)}")
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelError(f"{model_dir} has no tokenizer.json (a fast tokenizer is required)")
    heads = int(config["num_attention_heads"])
    return ModelInfo(
        model_dir=model_dir,
        architecture=supported[0],
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        eos_token_ids=_eos_token_ids(model_dir, config),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
    )


def resolve_model_facts(config: EngineConfig, info: ModelInfo) -> EngineConfig:
    """config with the model's facts resolved, as every process receives it: max_model_len 0
    becomes the model's context length (a longer one is refused), vocab_size 0 the model's
    vocabulary, served_model_name "" the model directory's name. No process reads config.json
    again, or falls back on its own, to learn them."""
    context = info.max_position_embeddings
    max_model_len = config.max_model_len or context
    if max_model_len > context:
        raise ValidationError(f"--max-model-len {max_model_len} exceeds the model's context length "
                              f"{context}", "max_model_len")
    return config.with_updates(max_model_len=max_model_len, vocab_size=config.vocab_size or info.vocab_size,
                               served_model_name=config.served_model_name or info.model_dir.name)


def needs_model_facts(config: EngineConfig) -> bool:
    """Whether a value resolve_model_facts fills in is still unset (a config built by hand)."""
    return not (config.max_model_len and config.vocab_size and config.served_model_name)


def _eos_token_ids(model_dir: Path, config: dict) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json and the tokenizer's eos_token, merged."""
    ids: list[int] = []
    sources = [config]
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        sources.append(json.loads(generation_path.read_text()))
    for source in sources:
        value = source.get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    tokenizer_eos = _tokenizer_eos_id(model_dir)
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    return tuple(sorted(set(int(i) for i in ids)))


def _tokenizer_eos_id(model_dir: Path) -> int | None:
    config_path = model_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    eos = json.loads(config_path.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    for added in vocab.get("added_tokens", []):
        if added.get("content") == eos:
            return int(added["id"])
    return vocab.get("model", {}).get("vocab", {}).get(eos)
