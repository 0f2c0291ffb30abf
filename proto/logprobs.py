"""Logprob entries: the lp_* arrays that StepResult and StepOutputs share, as one container.

Entry e: the log-probability of token token_ids[e] at sequence position positions[e] of row
rows[e], with its top alternatives (descending) in top_*[cu_top[e]:cu_top[e+1]]. Rows are plan
members in a StepResult and StepOutputs rows in a StepOutputs (see their docstrings).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_FIELDS = ("rows", "positions", "token_ids", "logprobs", "cu_top", "top_token_ids", "top_logprobs")


@dataclass(frozen=True)
class LogprobEntries:
    rows: np.ndarray  # int32 [num_entries] plan member, or StepOutputs row
    positions: np.ndarray  # int32 [num_entries]
    token_ids: np.ndarray  # int32 [num_entries]
    logprobs: np.ndarray  # float32 [num_entries]
    cu_top: np.ndarray  # int32 [num_entries + 1]
    top_token_ids: np.ndarray  # int32 [total_top] descending logprob within each entry
    top_logprobs: np.ndarray  # float32 [total_top]

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def of_message(cls, message: object) -> LogprobEntries:
        """The entries a StepResult or StepOutputs carries."""
        return cls(**{name: getattr(message, f"lp_{name}") for name in _FIELDS})

    def as_lp_fields(self) -> dict[str, np.ndarray]:
        """Keyword arguments for a StepResult or StepOutputs."""
        return {f"lp_{name}": getattr(self, name) for name in _FIELDS}

    def select(self, keep: np.ndarray, rows: np.ndarray) -> LogprobEntries:
        """The entries where `keep` (bool [num_entries]), with `rows` (int32 [num_kept]) as rows."""
        counts = np.diff(self.cu_top)[keep]  # int32 [num_kept]
        cu_top = np.zeros(len(counts) + 1, dtype=np.int32)  # int32 [num_kept + 1]
        np.cumsum(counts, out=cu_top[1:])
        # int64 [total_kept_top]: each kept entry's range of top alternatives, in order
        top_index = np.repeat(self.cu_top[:-1][keep] - cu_top[:-1], counts) + np.arange(cu_top[-1])
        return LogprobEntries(rows.astype(np.int32), self.positions[keep], self.token_ids[keep],
                              self.logprobs[keep], cu_top, self.top_token_ids[top_index],
                              self.top_logprobs[top_index])


def empty_entries() -> LogprobEntries:
    empty_i32, empty_f32 = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32)
    return LogprobEntries(empty_i32, empty_i32, empty_i32, empty_f32, np.zeros(1, dtype=np.int32),
                          empty_i32, empty_f32)


def concat_entries(parts: Sequence[LogprobEntries]) -> LogprobEntries:
    """Entries of several groups, one after the other (top-lists re-offset)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return empty_entries()
    top_offsets = np.cumsum([0] + [int(p.cu_top[-1]) for p in parts[:-1]])
    cu_top = np.concatenate([[0]] + [p.cu_top[1:] + offset for p, offset in zip(parts, top_offsets)])
    joined = {name: np.concatenate([getattr(p, name) for p in parts])
              for name in _FIELDS if name != "cu_top"}
    return LogprobEntries(cu_top=cu_top.astype(np.int32), **joined)
