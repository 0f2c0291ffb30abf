"""Loads an HF safetensors checkpoint (single file or sharded) into our model, mapping names on the fly."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from worker_proc.attention import AttentionBackend
from worker_proc.model import LlamaForCausalLM
from worker_proc.model_config import ModelConfig, load_model_config, torch_dtype

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that we recompute instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_dir: str | Path, dtype: str, backend: AttentionBackend,
               device: torch.device | None = None,
               show_progress: bool = True) -> LlamaForCausalLM:
    """Build the model in `dtype` on `device` (CPU by default) and fill every parameter from the
    checkpoint, or raise."""
    config = load_model_config(model_dir)
    with _default_dtype(torch_dtype(dtype)), device or torch.device("cpu"):
        model = LlamaForCausalLM(config, backend)
    names = checkpoint_tensor_names(model_dir)
    if "lm_head.weight" not in names and not config.tie_word_embeddings:
        log.info("checkpoint has no lm_head.weight: tying it to embed_tokens")
        model.tie_lm_head()
    load_weights(model, model_dir, names, show_progress)
    return model.eval()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def checkpoint_tensor_names(model_dir: str | Path) -> dict[str, tuple[Path, str]]:
    """Every tensor name the checkpoint provides -> (file, stored name).

    safetensors' save_model drops a tensor that shares storage with another and records
    {dropped name: kept name} in the file metadata; those aliases resolve to the kept tensor.
    """
    names: dict[str, tuple[Path, str]] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            stored = set(f.keys())
            names.update((name, (path, name)) for name in stored)
            for alias, target in (f.metadata() or {}).items():
                if target in stored and alias not in stored:
                    names[alias] = (path, target)
    return names


def load_weights(model: LlamaForCausalLM, model_dir: str | Path,
                 names: dict[str, tuple[Path, str]], show_progress: bool = True) -> None:
    params = dict(model.named_parameters())  # tied weights appear once, under embed_tokens
    loaded: set[tuple[str, object]] = set()
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (path, stored) in names.items():
        by_file.setdefault(path, []).append((name, stored))
    # On a terminal only: redirected to a log file, each refresh would be a line of its own.
    bar = tqdm(total=len(names), desc=f"Loading {Path(model_dir).name}", unit="tensor",
               disable=None if show_progress else True)
    with bar:
        for path, entries in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name, stored in entries:
                    piece = _load_one(model.config, params, name, lambda s=stored: f.get_tensor(s))
                    if piece:
                        loaded.add(piece)
                    bar.update(1)
    missing = sorted(f"{name}[{shard}]" if shard is not None else name
                     for name, shard in _expected_pieces(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} parameters, e.g. {missing[:5]}")


def _load_one(config: ModelConfig, params: dict, name: str,
              read: Callable[[], torch.Tensor]) -> tuple[str, object] | None:
    """Copy one checkpoint tensor into its (possibly fused) parameter; returns (our name, shard id)."""
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight" and "lm_head.weight" not in params:
        return None  # tied: the embedding table is the LM head
    ours, shard_id = name, None
    for hf_part, (our_part, shard) in LlamaForCausalLM.PACKED_MODULES.items():
        if f".{hf_part}." in name:
            ours, shard_id = name.replace(f".{hf_part}.", f".{our_part}."), shard
            break
    param = params.get(ours)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in a {config.model_type} model")
    param.weight_loader(param, read(), shard_id)
    return ours, shard_id


def _expected_pieces(params: dict) -> set[tuple[str, object]]:
    """(parameter, shard id) pairs a complete checkpoint fills: fused ones need every shard."""
    shards_of = {}
    for our_part, shard in LlamaForCausalLM.PACKED_MODULES.values():
        shards_of.setdefault(our_part, []).append(shard)
    pieces: set[tuple[str, object]] = set()
    for name in params:
        fused = next((part for part in shards_of if f".{part}." in name), None)
        pieces.update((name, shard) for shard in (shards_of[fused] if fused else [None]))
    return pieces
