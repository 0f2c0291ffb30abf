"""Converts a GGUF file into a standard HF checkpoint: `python -m worker_proc.tools.convert_gguf GGUF OUT_DIR`."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Keys transformers adds to a GGUF-loaded config that do not belong in a plain checkpoint.
_DROPPED_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path", "_commit_hash",
                        "transformers_version", "id2label", "label2id")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "bfloat16",
                 overwrite: bool = False) -> Path:
    """Dequantise with transformers, then write the checkpoint ourselves (transformers refuses
    save_pretrained on GGUF-loaded models). OUT_DIR appears complete or not at all."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists (pass --overwrite to replace it)")
    started = time.perf_counter()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _progress(started, f"loading tokenizer from {gguf_path.name}")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        _progress(started, "loading and dequantising weights")
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        _progress(started, f"writing model.safetensors ({dtype})")
        _write_weights(model, staging, SAVE_DTYPES[dtype])
        _write_configs(model, staging, dtype)
        _progress(started, "writing tokenizer and chat template")
        _write_tokenizer(tokenizer, staging, int(model.config.max_position_embeddings))
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _progress(started, f"done: {out_dir}")
    return out_dir


def _progress(started: float, message: str) -> None:
    print(f"[convert_gguf {time.perf_counter() - started:6.1f}s] {message}", flush=True)


def _write_weights(model: torch.nn.Module, out_dir: Path, dtype: torch.dtype) -> None:
    """A real model.embed_tokens.weight always; lm_head.weight only when it is not tied to it."""
    state = model.state_dict()
    tied = bool(model.config.tie_word_embeddings) or (
        "lm_head.weight" in state
        and state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr())
    tensors = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and tied:
            continue
        # clone: safetensors refuses tensors that share storage
        tensors[name] = tensor.detach().to(dtype).contiguous().clone()
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError("the GGUF model has no token embedding (model.embed_tokens.weight)")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.tie_word_embeddings = tied


def _write_configs(model: torch.nn.Module, out_dir: Path, dtype: str) -> None:
    config = model.config.to_dict()
    for key in _DROPPED_CONFIG_KEYS:
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = dtype
    config["dtype"] = dtype  # transformers 5 reads `dtype`, older versions `torch_dtype`
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {k: v for k, v in model.generation_config.to_dict().items()
                  if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _write_tokenizer(tokenizer: object, out_dir: Path, max_model_len: int) -> None:
    """tokenizer.save_pretrained, plus the chat template inside tokenizer_config.json, where
    every reader (ours and older transformers) finds it."""
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("model_max_length", 0) > max_model_len:  # GGUF leaves transformers' "unlimited"
        config["model_max_length"] = max_model_len
    template = getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
        if not (out_dir / "chat_template.jinja").is_file():
            (out_dir / "chat_template.jinja").write_text(template)
    else:
        print("[convert_gguf] warning: the GGUF file carries no chat template", flush=True)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _replace_dir(staging: Path, out_dir: Path) -> None:
    """Rename into place; an old directory is moved aside first and removed only afterwards."""
    staging.chmod(0o755)  # mkdtemp made it private; the checkpoint is meant to be shared
    for path in staging.iterdir():
        path.chmod(0o644)
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{time.time_ns()}")
        out_dir.rename(old)
    staging.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker_proc.tools.convert_gguf",
                                     description="Convert a Llama-family GGUF file to HF safetensors.")
    parser.add_argument("gguf_path")
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", choices=sorted(SAVE_DTYPES), default="bfloat16",
                        help="dtype of the saved weights (default: bfloat16, the engine's default)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    args = parser.parse_args(argv)
    try:
        convert_gguf(args.gguf_path, args.out_dir, args.dtype, args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"convert_gguf: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
