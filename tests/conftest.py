"""Shared fixtures: a tiny random Llama saved as an HF checkpoint, loaded through the real loader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import hides_gpus
from tiny_model import build_tiny_model

from deploy.devices import visible_gpus

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_workers: the workers this test starts run on the CPU, "
                                       "whatever GPUs the machine has (CUDA_VISIBLE_DEVICES='')")
    config.addinivalue_line("markers", "ranks(n): the test starts n worker ranks on this machine: on "
                                       "GPUs where n are visible, else on the CPU")


@pytest.fixture(autouse=True)
def _place_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with GPUs a stack places each worker on one, so a test that means CPU workers,
    or more ranks than there are GPUs, hides them from the processes it starts."""
    ranks, gpus = request.node.get_closest_marker("ranks"), visible_gpus()
    if hides_gpus(ranks.args[0] if ranks else None, request.node.get_closest_marker("cpu_workers") is not None,
                  gpus):
        if gpus:  # CUDA reads the variable once: this process keeps its GPUs for later tests
            import torch

            torch.cuda.is_available()
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
