"""bench_linears times both paths on every shape and sums a decode step, after checking both
against the exact product."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from worker_proc.layers.skinny import skinny_linear_for


def test_it_reports_every_shape_and_the_step() -> None:
    if skinny_linear_for(torch.float32, "") is None:
        pytest.skip("no fp32 skinny linear on this CPU")
    done = subprocess.run([sys.executable, "-m", "worker_proc.tools.bench_linears", "--dtype", "float32",
                           "--rows", "2", "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["shape"] for line in lines] == ["qkv", "o", "gate_up", "down", "lm_head", "step"]
    assert all(line["rows"] == 2 and line["speedup"] > 0 for line in lines)
    assert lines[-1]["onednn_ms"] > 0 and lines[-1]["skinny_ms"] > 0 and lines[-1]["skinny_wide_ms"] > 0
    assert all(line["wide_speedup"] > 0 for line in lines)  # fp32: bf16 panels beside the fp32 ones
