"""proto.trace: the trace file keeps every entry as written and refuses, with its line, one
that cannot be replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proto.trace import TraceEntry, load_trace, save_trace


def test_a_saved_trace_loads_back_entry_for_entry(tmp_path: Path) -> None:
    entries = [TraceEntry(0.5, [3, 1, 4], 2), TraceEntry(0.0, [1], 7)]
    save_trace(entries, tmp_path / "nested" / "t.jsonl")
    assert load_trace(tmp_path / "nested" / "t.jsonl") == entries


@pytest.mark.parametrize("entry, message", [
    ({"arrival_s": 0.0, "prompt_token_ids": [5], "output_len": 0}, "output_len must be >= 1, got 0"),
    ({"arrival_s": -1.0, "prompt_token_ids": [5], "output_len": 3}, "arrival_s must be"),
    ({"arrival_s": 0.0, "prompt_token_ids": [], "output_len": 3}, "prompt_token_ids is empty"),
    ({"arrival_s": 0.0, "prompt_token_ids": [4, -2], "output_len": 3}, "prompt_token_ids holds a negative id -2"),
    ({"arrival_s": 0.0, "prompt_token_ids": [4]}, "not a trace entry"),
])
def test_a_trace_entry_that_cannot_be_replayed_is_refused_with_its_line(tmp_path: Path, entry: dict,
                                                                          message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"arrival_s": 0.0, "prompt_token_ids": [5], "output_len": 2}) + "\n"
                    + json.dumps(entry) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: {message}"):
        load_trace(path)


def test_an_empty_trace_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no trace entries"):
        load_trace(tmp_path / "empty.jsonl")
