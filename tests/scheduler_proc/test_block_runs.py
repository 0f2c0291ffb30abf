"""block_runs: the decodes' block tables of a replayed trace, their runs, and the saved tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from proto.trace import TraceEntry, save_trace
from scheduler_proc.tools.block_runs import RunStats, main, run, serve_config


def test_run_stats_weigh_each_block_read_by_the_length_of_its_run() -> None:
    stats = RunStats()
    stats.add(np.array([4, 5, 6, 9, 2], dtype=np.int32))  # runs of 3, 1, 1
    assert (stats.num_reads, stats.run_weighted_reads, stats.lone_reads) == (5, 11, 2)


def test_one_sequence_grows_in_one_run_of_blocks() -> None:
    entries = [TraceEntry(0.0, list(range(100, 140)), 30)]  # 40 prompt tokens, then 29 decodes
    stats, steps = run(entries, serve_config(entries, num_kv_blocks=10))
    assert len(steps) == 30
    # contexts 41-48 read 3 blocks, 49-64 read 4, 65-69 read 5, always blocks 0, 1, 2, ...
    assert stats.num_reads == 8 * 3 + 16 * 4 + 5 * 5
    assert stats.run_weighted_reads == 8 * 9 + 16 * 16 + 5 * 25 and stats.lone_reads == 0
    tables, contexts = steps[-1]
    assert contexts == [69] and tables[0].tolist() == [0, 1, 2, 3, 4]


def test_two_sequences_growing_side_by_side_each_add_lone_blocks() -> None:
    entries = [TraceEntry(0.0, list(range(100, 140)), 30), TraceEntry(0.0, list(range(200, 240)), 30)]
    stats, steps = run(entries, serve_config(entries, num_kv_blocks=20))
    tables, _ = steps[-1]
    assert [t.tolist() for t in tables] == [[0, 1, 2, 6, 8], [3, 4, 5, 7, 9]]
    assert stats.lone_reads == 2 * (16 * 1 + 5 * 2)


def test_main_saves_tables_that_load_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, saved = tmp_path / "trace.jsonl", tmp_path / "tables.npz"
    save_trace([TraceEntry(0.0, list(range(100, 140)), 30)], trace)
    assert main(["--trace", str(trace), "--num-kv-blocks", "10", "--save-tables", str(saved)]) == 0
    assert "30 steps; 113 block reads" in capsys.readouterr().out
    arrays = np.load(saved)
    assert int(arrays["num_kv_blocks"]) == 10 and int(arrays["block_size"]) == 16
    names = sorted(n for n in arrays.files if n.endswith("_tables"))
    assert names and all(arrays[n].shape[0] == len(arrays[n[:-7] + "_contexts"]) for n in names)


def test_main_refuses_an_empty_trace_or_no_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty, trace = tmp_path / "empty.jsonl", tmp_path / "trace.jsonl"
    empty.write_text("")
    save_trace([TraceEntry(0.0, [100, 101], 2)], trace)
    assert main(["--trace", str(empty), "--num-kv-blocks", "10"]) == 2
    assert main(["--trace", str(trace), "--num-kv-blocks", "0"]) == 2
    assert "--num-kv-blocks must be >= 1, got 0" in capsys.readouterr().err
