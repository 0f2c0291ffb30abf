"""Logprob entries (proto StepResult / StepOutputs lp_* format), re-indexed from plan members to
StepOutputs rows; the scheduler only moves them, the worker computes them.

Entry e: the log-probability of token token_ids[e] at sequence position positions[e] of row
rows[e], with its top alternatives in top_*[cu_top[e]:cu_top[e+1]]. A position below the
prompt length is a prompt token (prompt_logprobs), the others are sampled tokens (logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proto.messages import StepResult
from scheduler_proc.request import Request

_FIELDS = ("rows", "positions", "token_ids", "logprobs", "cu_top", "top_token_ids", "top_logprobs")


@dataclass(frozen=True)
class LogprobEntries:
    rows: np.ndarray  # int32 [num_entries] plan member, or StepOutputs row once forwarded
    positions: np.ndarray  # int32 [num_entries]
    token_ids: np.ndarray  # int32 [num_entries]
    logprobs: np.ndarray  # float32 [num_entries]
    cu_top: np.ndarray  # int32 [num_entries + 1]
    top_token_ids: np.ndarray  # int32 [total_top]
    top_logprobs: np.ndarray  # float32 [total_top]

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def of_result(cls, result: StepResult) -> LogprobEntries:
        return cls(result.lp_rows, result.lp_positions, result.lp_token_ids, result.lp_logprobs,
                   result.lp_cu_top, result.lp_top_token_ids, result.lp_top_logprobs)

    def as_output_fields(self) -> dict[str, np.ndarray]:
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


def concat_entries(parts: Sequence[LogprobEntries]) -> LogprobEntries:
    if len(parts) == 1:
        return parts[0]
    if not parts:
        empty_i32, empty_f32 = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32)
        return LogprobEntries(empty_i32, empty_i32, empty_i32, empty_f32, np.zeros(1, dtype=np.int32),
                              empty_i32, empty_f32)
    top_offsets = np.cumsum([0] + [int(p.cu_top[-1]) for p in parts[:-1]])
    cu_top = np.concatenate([[0]] + [p.cu_top[1:] + offset for p, offset in zip(parts, top_offsets)])
    joined = {name: np.concatenate([getattr(p, name) for p in parts])
              for name in _FIELDS if name != "cu_top"}
    return LogprobEntries(cu_top=cu_top.astype(np.int32), **joined)


def entries_error(result: StepResult, num_seqs: int) -> str:
    """Why the result's entries cannot be forwarded ("" if they can)."""
    rows = result.lp_rows
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= num_seqs):
        return f"it returned logprob entries for members {rows.min()}..{rows.max()} of {num_seqs}"
    return ""


def forward_entries(result: StepResult, requests: Sequence[Request], member_rows: np.ndarray,
                    prompt_logprob_rows: Sequence[int]) -> LogprobEntries:
    """The result's entries re-indexed to output rows (member_rows: int32 [num_seqs], -1 = the
    member has no output, e.g. aborted while the step ran).

    A sequence that is recomputing its prompt after a preemption gets its prompt entries again
    from the worker; those at positions already forwarded are dropped, so each prompt position
    reaches the frontend once.
    """
    entries = LogprobEntries.of_result(result)
    out_rows = member_rows[entries.rows]  # int32 [num_entries]
    keep = out_rows >= 0
    if prompt_logprob_rows:
        first_new = np.zeros(len(requests), dtype=np.int64)  # int64 [num_seqs]
        prompt_end = np.zeros(len(requests), dtype=np.int64)  # int64 [num_seqs]
        for row in prompt_logprob_rows:
            first_new[row] = requests[row].next_prompt_logprob_position
            prompt_end[row] = requests[row].num_prompt_tokens
        is_prompt = entries.positions < prompt_end[entries.rows]
        keep &= ~is_prompt | (entries.positions >= first_new[entries.rows])
        forwarded = keep & is_prompt
        last = np.zeros(len(requests), dtype=np.int64)  # int64 [num_seqs]
        np.maximum.at(last, entries.rows[forwarded], entries.positions[forwarded])
        for row in prompt_logprob_rows:
            request = requests[row]
            request.next_prompt_logprob_position = max(request.next_prompt_logprob_position, int(last[row]) + 1)
    return entries.select(keep, out_rows[keep])
