"""Lets the scheduler tests import their fakes (scheduler_fakes) under --import-mode=importlib, and
gives the grammar tests a tiny tokenizer (the scheduler builds its token table from tokenizer.json)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tokenizers
from tiny_model import build_tiny_tokenizer

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)  # appended: never shadows tests/conftest.py or the real scheduler_proc


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding only the tiny tokenizer."""
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def backend(tokenizer_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
