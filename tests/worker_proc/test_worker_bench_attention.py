"""bench_attention on a served trace's decode tables (scheduler_proc.tools.block_runs' file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from native_levels import VECTOR_LEVELS

from worker_proc.attention.native_build import SOURCE_DIR
from worker_proc.tools import bench_attention


def _save(path: Path, block_size: int) -> None:
    tables = np.array([[3, 4, 0], [7, 1, 2]], dtype=np.int32)  # member 0 reads 2 blocks, member 1 three
    np.savez(path, num_kv_blocks=np.array(10), block_size=np.array(block_size),
             step5_tables=tables, step5_contexts=np.array([20, 40], dtype=np.int32))


def test_each_saved_step_is_timed_as_served_shuffled_and_consecutive(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path / "t.npz", 16)
    assert bench_attention.main(["--decode-tables", str(tmp_path / "t.npz"), "--dtypes", "float32",
                                 "--repeats", "2", "--cache-copies", "2", "--num-threads", "1",
                                 "--sources", f"{SOURCE_DIR},{SOURCE_DIR}"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["case"], row["build"]) for row in rows] == [("step5: 2 decodes", str(SOURCE_DIR))] * 2
    for row in rows:  # one row per build, each timed on every layout
        assert set(row["ms"]) == set(bench_attention.LAYOUTS) and min(row["ms"].values()) > 0


def test_tables_of_another_block_size_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path / "t.npz", 32)
    assert bench_attention.main(["--decode-tables", str(tmp_path / "t.npz"), "--dtypes", "float32"]) == 2
    assert "pass --block-size 32" in capsys.readouterr().err


def test_block_sizes_are_timed_side_by_side_each_on_its_own_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_attention.main(["--block-sizes", "16,32", "--dtypes", "float32", "--prefill-tokens", "40",
                                 "--decode-seqs", "3", "--decode-context", "50", "--repeats", "2",
                                 "--cache-copies", "2", "--num-threads", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["case"] for row in rows] == ["prefill", "decode"]
    for row in rows:
        assert set(row["ms"]) == {"block 16", "block 32"} and min(row["ms"].values()) > 0


def test_split_positions_are_timed_side_by_side_on_each_build(capsys: pytest.CaptureFixture[str]) -> None:
    """Decodes of 50 positions: whole (0) and in parts of 16, the same results within rounding."""
    assert bench_attention.main(["--split-positions", "0,16", "--dtypes", "float32", "--prefill-tokens", "0",
                                 "--decode-seqs", "2", "--decode-context", "50", "--repeats", "2",
                                 "--num-threads", "2"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert list(row["ms"]) == [f"{SOURCE_DIR} split 0", f"{SOURCE_DIR} split 16"] and min(row["ms"].values()) > 0
    assert row["max_abs_diff_from_first"][0] == 0.0 and 0.0 < row["max_abs_diff_from_first"][1] < 1e-5
    assert bench_attention.main(["--split-positions", "24"]) == 2
    assert "--split-positions takes 0 or multiples of 16, got '24'" in capsys.readouterr().err


def test_a_block_size_that_is_not_a_positive_integer_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_attention.main(["--block-sizes", "16,x"]) == 2
    assert "--block-sizes and --split-positions take integers" in capsys.readouterr().err
    assert bench_attention.main(["--block-sizes", "0"]) == 2
    assert "--block-sizes must be >= 1" in capsys.readouterr().err


def test_builds_are_compiled_under_the_isa_cap_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    """Held to baseline x86-64, the build has only its portable loop: each row says which path ran."""
    assert bench_attention.main(["--cpu-isa", "baseline", "--dtypes", "float32", "--prefill-tokens", "40",
                                 "--decode-seqs", "3", "--decode-context", "50", "--repeats", "2",
                                 "--num-threads", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["case"], list(row["path"].values())) for row in rows] == [("prefill", ["portable"]),
                                                                           ("decode", ["portable"])]


def test_builds_attend_copies_of_the_caches_each_with_the_same_result(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """--cache-copies 3: every build's round goes to each of three copies of the caches in turn (a
    step's layers); the copies hold the same K and V, so the output is the same build to build."""
    seen: list[int] = []
    call = bench_attention.PagedAttentionKernel.__call__

    def counting(self, q, out, k_cache, *rest, **split):
        seen.append(k_cache.data_ptr())
        return call(self, q, out, k_cache, *rest, **split)

    monkeypatch.setattr(bench_attention.PagedAttentionKernel, "__call__", counting)
    assert bench_attention.main(["--cache-copies", "3", "--dtypes", "float32", "--prefill-tokens", "0",
                                 "--decode-seqs", "3", "--decode-context", "50", "--repeats", "2",
                                 "--num-threads", "1", "--sources", f"{SOURCE_DIR},{SOURCE_DIR}"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["max_abs_diff_from_first"] == [0.0, 0.0] and min(row["ms"].values()) > 0
    assert len(seen) == 2 * 2 * 3 and len(set(seen)) == 3 and seen[:3] == seen[3:6]
    assert bench_attention.main(["--cache-copies", "0"]) == 2
    assert "--cache-copies must be >= 1" in capsys.readouterr().err


@pytest.mark.skipif("avx2" not in VECTOR_LEVELS, reason="the AVX2 build needs AVX2")
def test_an_fp32_model_over_a_bf16_cache_is_a_dtype_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    """float32-over-bfloat16: fp32 q and output over bf16 caches, the kernel's mixed path."""
    assert bench_attention.main(["--dtypes", "float32-over-bfloat16", "--prefill-tokens", "20",
                                 "--decode-seqs", "3", "--decode-context", "50", "--repeats", "2",
                                 "--num-threads", "1", "--cpu-isa", "avx2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["case"], list(row["path"].values())) for row in rows] == [("prefill", ["avx2"]), ("decode", ["avx2"])]
    assert bench_attention.main(["--dtypes", "float16"]) == 2
    assert "--dtypes takes float32, bfloat16, float32-over-bfloat16, got float16" in capsys.readouterr().err
