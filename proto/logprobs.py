"""Logprob entries: the one container StepResult and StepOutputs carry (their `logprobs` field).

Entry e: the log-probability of token token_ids[e] at sequence position positions[e] of row
rows[e], its rank there (how many tokens have a logprob at least as high, itself included, as vLLM
counts it; computed for prompt tokens only, 0 for sampled ones), and its top alternatives
(descending) in top_*[cu_top[e]:cu_top[e+1]]. Rows are plan
members in a StepResult and StepOutputs rows in a StepOutputs (see their docstrings).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from proto.arrays import Float32Array, Int32Array, empty


@dataclass(frozen=True)
class LogprobEntries:
    rows: Int32Array = field(default_factory=empty(np.int32))  # [num_entries] plan member, or StepOutputs row
    positions: Int32Array = field(default_factory=empty(np.int32))  # [num_entries]
    token_ids: Int32Array = field(default_factory=empty(np.int32))  # [num_entries]
    logprobs: Float32Array = field(default_factory=empty(np.float32))  # [num_entries]
    ranks: Int32Array = field(default_factory=empty(np.int32))  # [num_entries] 1 = the most likely; 0 = not computed
    cu_top: Int32Array = field(default_factory=empty(np.int32, 1))  # [num_entries + 1]
    top_token_ids: Int32Array = field(default_factory=empty(np.int32))  # [total_top] descending within each entry
    top_logprobs: Float32Array = field(default_factory=empty(np.float32))  # [total_top]

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, keep: np.ndarray, rows: np.ndarray) -> LogprobEntries:
        """The entries where `keep` (bool [num_entries]), with `rows` (int32 [num_kept]) as rows."""
        counts = np.diff(self.cu_top)[keep]  # int32 [num_kept]
        cu_top = np.zeros(len(counts) + 1, dtype=np.int32)  # int32 [num_kept + 1]
        np.cumsum(counts, out=cu_top[1:])
        # int64 [total_kept_top]: each kept entry's range of top alternatives, in order
        top_index = np.repeat(self.cu_top[:-1][keep] - cu_top[:-1], counts) + np.arange(cu_top[-1])
        return LogprobEntries(rows.astype(np.int32), self.positions[keep], self.token_ids[keep],
                              self.logprobs[keep], self.ranks[keep], cu_top, self.top_token_ids[top_index],
                              self.top_logprobs[top_index])


def empty_entries() -> LogprobEntries:
    return LogprobEntries()


def concat_entries(parts: Sequence[LogprobEntries]) -> LogprobEntries:
    """Entries of several groups, one after the other (top-lists re-offset)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return empty_entries()
    top_offsets = np.cumsum([0] + [int(p.cu_top[-1]) for p in parts[:-1]])
    cu_top = np.concatenate([[0]] + [p.cu_top[1:] + offset for p, offset in zip(parts, top_offsets)])
    joined = {f.name: np.concatenate([getattr(p, f.name) for p in parts])
              for f in fields(LogprobEntries) if f.name != "cu_top"}
    return LogprobEntries(cu_top=cu_top.astype(np.int32), **joined)
