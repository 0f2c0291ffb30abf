"""The trace file, the one format a workload travels in between processes.

A trace is JSONL, one request per line, in any order:

    {"arrival_s": 0.25, "prompt_token_ids": [512, 77, 9031], "output_len": 48}

`arrival_s` is the request's offset from the start of the run in seconds (finite, >= 0),
`prompt_token_ids` its prompt (non-empty, ids >= 0), and `output_len` how many tokens it asks for
(>= 1; replayed with `ignore_eos`, so it gets exactly that many). Other keys are ignored. deploy's
generator writes it (`conveyor bench --save-trace`), `conveyor bench --trace` replays it against a
server, and `conveyor simulate` hands its workload to the slot simulator in it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceEntry:
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: list[int]
    output_len: int


def save_trace(entries: list[TraceEntry], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for entry in entries:
            out.write(json.dumps(asdict(entry)) + "\n")


def load_trace(path: Path) -> list[TraceEntry]:
    """Every entry of the file at `path`, in file order. Raises ValueError naming the file and line
    of the first entry that is not one (or OSError for an unreadable file)."""
    entries = []
    with open(path) as src:
        for line_no, line in enumerate(src, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                entry = TraceEntry(float(raw["arrival_s"]), [int(t) for t in raw["prompt_token_ids"]],
                                   int(raw["output_len"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a trace entry: {exc}") from exc
            problem = _entry_problem(entry)
            if problem:
                raise ValueError(f"{path}:{line_no}: {problem}")
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path} holds no trace entries")
    return entries


def _entry_problem(entry: TraceEntry) -> str:
    if not (math.isfinite(entry.arrival_s) and entry.arrival_s >= 0):
        return f"arrival_s must be a finite number >= 0, got {entry.arrival_s}"
    if not entry.prompt_token_ids:
        return "prompt_token_ids is empty"
    if min(entry.prompt_token_ids) < 0:
        return f"prompt_token_ids holds a negative id {min(entry.prompt_token_ids)}"
    if entry.output_len < 1:
        return f"output_len must be >= 1, got {entry.output_len}"
    return ""
