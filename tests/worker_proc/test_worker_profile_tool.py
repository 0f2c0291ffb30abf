"""The step profiler: exclusive times add up to the step, every category of a real step is seen."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from worker_proc.attention.native_kernel import vectorised_library
from worker_proc.model_config import load_model_config
from worker_proc.tools import profile_step
from worker_proc.tools.stopwatch import Stopwatch


def test_nested_calls_are_timed_exclusively_so_categories_add_up() -> None:
    watch = Stopwatch()
    inner = watch.wrap(lambda: time.sleep(0.02), "inner")
    outer = watch.wrap(lambda: (time.sleep(0.01), inner(), inner()), "outer")
    started = time.perf_counter()
    outer()
    elapsed = time.perf_counter() - started
    seconds = watch.take()
    assert 0.04 <= seconds["inner"] < 0.06 and 0.01 <= seconds["outer"] < 0.02
    assert abs(sum(seconds.values()) - elapsed) < 0.002
    assert watch.take() == {}


def test_a_profile_of_the_tiny_model_splits_each_step_and_sets_compute_against_its_floor(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    profile_step.main(["--model", str(tiny_model_dir), "--decode-batches", "4", "--context", "40",
                       "--prefill", "64", "--steps", "2", "--num-threads", "1", "--no-scheduler",
                       "--out", str(out)])
    report = json.loads(out.read_text())
    peak = report["peak"]
    assert peak["memory_gbps"] > 0 and peak["memory_copy_gbps"] > 0 and peak["float32_gflops"]["qkv"] > 0
    for name in ("prefill_64", "decode_4x40"):
        ms = report["steps"][name]["ms"]
        assert {"linears", "attention", "norms", "rope", "activations", "lm_head", "sampler",
                "plan building", "layer glue", "runner glue"} <= set(ms)
        parts = sum(v for k, v in ms.items() if k != "total")
        assert abs(parts - ms["total"]) <= 0.1 * ms["total"]  # medians per category, so not exact
        assert set(report["steps"][name]["floor_ms"]) == {"linears", "lm_head", "attention"}
        if not isinstance(vectorised_library(torch.float32, (torch.float32,), "", "skinny_linear_supported"), str):
            # the worker runs these steps' layers in one native call: its total beside the categories
            assert report["steps"][name]["one_call_total_ms"] > 0


def test_a_bfloat16_profile_measures_both_peaks_with_the_kernel_of_each_dtype(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """Where the worker's LM head has the bf16 kernel, the fp32 peak must not be asked of it."""
    out = tmp_path / "profile.json"
    profile_step.main(["--model", str(tiny_model_dir), "--dtype", "bfloat16", "--decode-batches", "2",
                       "--context", "20", "--prefill", "32", "--steps", "1", "--num-threads", "1",
                       "--no-scheduler", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16"
    for dtype in ("float32", "bfloat16"):
        assert all(gflops > 0 for gflops in report["peak"][f"{dtype}_gflops"].values())
    assert report["steps"]["decode_2x20"]["ms"]["lm_head"] > 0


def test_a_profile_takes_the_kv_cache_dtype_and_the_isa_cap_and_floors_the_cache_reads_by_them(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    profile_step.main(["--model", str(tiny_model_dir), "--kv-cache-dtype", "bfloat16", "--cpu-isa", "baseline",
                       "--decode-batches", "2", "--context", "20", "--prefill", "0", "--steps", "1",
                       "--num-threads", "1", "--no-scheduler", "--out", str(out)])
    report = json.loads(out.read_text())
    assert (report["dtype"], report["kv_cache_dtype"], report["cpu_isa_cap"]) == ("float32", "bfloat16", "baseline")
    assert report["steps"]["decode_2x20"]["ms"]["attention"] > 0
    model = load_model_config(tiny_model_dir)
    contexts, scheduled = np.array([300, 500]), np.array([1, 1])
    bound_by_reads = dict(peak_gflops=1e9, gbps=1.0)  # every floor is the bytes read
    fp32 = profile_step.floors(model, contexts, scheduled, 4, **bound_by_reads)
    bf16_cache = profile_step.floors(model, contexts, scheduled, 4, kv_bytes=2, **bound_by_reads)
    assert bf16_cache["attention"] == fp32["attention"] / 2 and bf16_cache["linears"] == fp32["linears"]


def test_the_linear_floor_counts_the_weights_as_the_worker_holds_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A bf16 checkpoint profiled in fp32: where the skinny linear keeps bf16 panels, a weight's
    bytes read are 2, not 4 (else a memory-bound decode would beat its own floor)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from worker_proc.layers.skinny import skinny_linear_for

    if skinny_linear_for(torch.float32, "") is None:
        pytest.skip("no fp32 skinny linear on this CPU")
    bf16_dir = tmp_path / "bf16-checkpoint"
    shutil.copytree(tiny_model_dir, bf16_dir)
    weights = bf16_dir / "model.safetensors"
    save_file({k: v.bfloat16() for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    sizes = []
    for model_dir in (tiny_model_dir, bf16_dir):
        out = tmp_path / f"{model_dir.name}.json"
        profile_step.main(["--model", str(model_dir), "--decode-batches", "1", "--context", "10", "--prefill", "0",
                           "--steps", "1", "--num-threads", "1", "--no-scheduler", "--out", str(out)])
        sizes.append(json.loads(out.read_text())["weight_bytes"])
    assert sizes == [4, 2]
