"""Logprob entries (proto LogprobEntries), re-indexed from plan members to StepOutputs rows; the
scheduler only moves them, the worker computes them.

A position below the prompt length is a prompt token (prompt_logprobs), the others are sampled
tokens (logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from proto.logprobs import LogprobEntries
from proto.messages import StepResult
from scheduler_proc.request import Request


def entries_error(result: StepResult, num_seqs: int) -> str:
    """Why the result's entries cannot be forwarded ("" if they can)."""
    rows = result.logprobs.rows
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
    entries = result.logprobs
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
            requests[row].forwarded_prompt_logprobs(int(last[row]) + 1)
    return entries.select(keep, out_rows[keep])
