"""Collect per-choice token deltas, finishes, lifecycle events and logprobs, then pack them into
one proto StepOutputs."""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from proto.logprobs import LogprobEntries, concat_entries
from proto.messages import (ERROR_NONE, EVENT_FINISHED, FinishReason, LifecycleEvents, SchedulerStats,
                            StepOutputs)
from scheduler_proc.request import Request

HEARTBEAT_STEP_ID = -1  # step_id of StepOutputs that belong to no step (heartbeats, flushes)


class OutputOwner(NamedTuple):
    """Who an output belongs to when there is no Request for it (a rejected request's choice);
    a Request has the same three attributes."""

    request_id: str
    choice_index: int
    num_cached_tokens: int


class OutputBuffer:
    """Pending entries for the next StepOutputs: at most one output per (request, choice), each
    with at most one new token, and every terminal output comes with a FINISHED event.

    Output row i is (request_ids[i], choice_indices[i]); num_cached_tokens[i] is that choice's
    prompt tokens served by the prefix cache at its first scheduling (the same on every output
    of the choice, 0 before it is scheduled). A row may carry no token (a terminal output, or a
    prefill chunk's prompt logprobs).

    Lifecycle events, per choice, on the scheduler's wall clock: QUEUED when added (every choice
    of a request at once), SCHEDULED the first time it is scheduled, FIRST_TOKEN with its first
    output token, PREEMPTED at each preemption, FINISHED with its terminal output. A rejected
    request's choices get FINISHED only; a duplicate request id gets no events. Events ride with
    the next StepOutputs built (a step's outputs, or a heartbeat).
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._owners: list[Request | OutputOwner] = []  # per row
        self._token_ids: list[int] = []  # per row: its new token, or -1 for none
        self._finishes: dict[int, tuple[FinishReason, str]] = {}  # row -> (finish reason, error message)
        self._error_codes: dict[int, int] = {}  # row -> ERROR_* code, for the rare coded errors
        self._event_request_ids: list[str] = []
        self._event_choice_indices: list[int] = []
        self._event_kinds: list[int] = []
        self._event_times_s: list[float] = []
        self._logprobs: list[LogprobEntries] = []

    def __len__(self) -> int:
        return len(self._owners)

    def add(self, owner: Request | OutputOwner, token_id: int = -1,
            finish_reason: FinishReason = FinishReason.NONE,
            error_message: str = "", time_s: float = 0.0, finished_event: bool = True,
            error_code: int = ERROR_NONE) -> int:
        """Queue one output (a terminal one also gets a FINISHED event at `time_s`, unless it
        answers a duplicate request id, whose lifecycle belongs to the live request); its row.
        `error_code` (an ERROR_* value) only goes with FinishReason.ERROR."""
        row = len(self._owners)
        self._owners.append(owner)
        self._token_ids.append(token_id)
        if error_code != ERROR_NONE:
            assert finish_reason == FinishReason.ERROR, f"error code {error_code} on a {finish_reason!r} finish"
            self._error_codes[row] = error_code
        if finish_reason:
            self._finishes[row] = (finish_reason, error_message)
            if finished_event:
                self.add_event(owner.request_id, owner.choice_index, EVENT_FINISHED, time_s)
        return row

    def add_token(self, request: Request, token_id: int) -> int:
        """add() for the common output: one new token, not terminal."""
        self._owners.append(request)
        self._token_ids.append(token_id)
        return len(self._owners) - 1

    def add_event(self, request_id: str, choice_index: int, kind: int, time_s: float) -> None:
        self._event_request_ids.append(request_id)
        self._event_choice_indices.append(choice_index)
        self._event_kinds.append(kind)
        self._event_times_s.append(time_s)

    def add_logprobs(self, entries: LogprobEntries) -> None:
        """Entries whose rows index this buffer's outputs."""
        self._logprobs.append(entries)

    def build(self, step_id: int, stats: SchedulerStats, step_duration_s: float,
              num_scheduled_tokens: int = 0) -> StepOutputs:
        """Pack and clear the pending entries."""
        owners = self._owners
        token_ids = np.array(self._token_ids, dtype=np.int32)  # int32 [num_outputs], -1 = none
        has_token = token_ids >= 0  # bool [num_outputs]
        cu_new_tokens = np.zeros(len(owners) + 1, dtype=np.int32)  # int32 [num_outputs + 1]
        np.cumsum(has_token, out=cu_new_tokens[1:])
        finish_reasons, error_messages = [FinishReason.NONE] * len(owners), [""] * len(owners)
        for row, (reason, message) in self._finishes.items():
            finish_reasons[row], error_messages[row] = reason, message
        # uint8 [num_outputs] ERROR_* codes; empty (the common case) when no row has one
        error_codes = np.zeros(len(owners) if self._error_codes else 0, dtype=np.uint8)
        for row, code in self._error_codes.items():
            error_codes[row] = code
        events = LifecycleEvents(
            request_ids=self._event_request_ids,
            choice_indices=np.array(self._event_choice_indices, dtype=np.int32),  # int32 [num_events]
            kinds=np.array(self._event_kinds, dtype=np.uint8),  # uint8 [num_events]
            times_s=np.array(self._event_times_s, dtype=np.float64),  # float64 [num_events]
        )
        outputs = StepOutputs(
            step_id=step_id,
            request_ids=[owner.request_id for owner in owners],
            cu_new_tokens=cu_new_tokens,
            new_token_ids=token_ids[has_token],  # int32 [total_new_tokens]
            finish_reasons=finish_reasons,
            error_messages=error_messages,
            stats=stats,
            step_duration_s=step_duration_s,
            wall_time_s=time.time(),
            num_scheduled_tokens=num_scheduled_tokens,
            choice_indices=np.array([o.choice_index for o in owners], dtype=np.int32),  # int32 [num_outputs]
            num_cached_tokens=np.array([o.num_cached_tokens for o in owners], dtype=np.int32),
            error_codes=error_codes,
            events=events,
            logprobs=concat_entries(self._logprobs),
        )
        self._reset()
        return outputs
