"""Shared fixtures: a tiny random Llama saved as an HF checkpoint, loaded through the real loader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tiny_model import build_tiny_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
