"""Fixtures that spin up the real stack (every process, real ZMQ) on the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support import tiny_config

from deploy.launcher import Stack


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tiny_config(tiny_model_dir), log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running
