"""bench_linears times both paths on every shape and sums a decode step, after checking both
against the exact product; with --sources, it times the builds of source directories against each
other on a whole decode step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from worker_proc.attention.native_build import SOURCE_DIR
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


def test_sources_time_each_build_on_a_whole_step() -> None:
    if skinny_linear_for(torch.float32, "") is None:
        pytest.skip("no fp32 skinny linear on this CPU")
    done = subprocess.run([sys.executable, "-m", "worker_proc.tools.bench_linears", "--dtype", "float32",
                           "--rows", "1,3", "--rounds", "1", "--sources", f"{SOURCE_DIR},{SOURCE_DIR}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["rows"] for line in lines] == [1, 3]
    for line in lines:
        assert line["sources"] == [str(SOURCE_DIR)] * 2
        assert len(line["step_ms"]) == 2 and all(t > 0 for t in line["step_ms"])
        assert line["speedup_over_first"][0] == 1.0 and line["same_bits_as_first"] == [True, True]
