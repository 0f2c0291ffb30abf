"""Collect per-request token deltas and finishes, then pack them into one proto StepOutputs."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from proto.messages import StepOutputs

HEARTBEAT_STEP_ID = -1  # step_id of StepOutputs that belong to no step (heartbeats, flushes)


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_preemptions_total: int
    num_padded_slot_steps_total: int  # static policy: seat-steps held by finished requests


class OutputBuffer:
    """Pending entries for the next StepOutputs, at most one per request."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._request_ids: list[str] = []
        self._token_ids: list[int] = []
        self._num_tokens: list[int] = []
        self._finish_reasons: list[str] = []
        self._error_messages: list[str] = []

    def __len__(self) -> int:
        return len(self._request_ids)

    def add(self, request_id: str, token_ids: list[int], finish_reason: str = "",
            error_message: str = "") -> None:
        self._request_ids.append(request_id)
        self._token_ids.extend(token_ids)
        self._num_tokens.append(len(token_ids))
        self._finish_reasons.append(finish_reason)
        self._error_messages.append(error_message)

    def build(self, step_id: int, stats: SchedulerStats, step_duration_s: float,
              num_scheduled_tokens: int = 0) -> StepOutputs:
        """Pack and clear the pending entries."""
        cu_new_tokens = np.zeros(len(self._num_tokens) + 1, dtype=np.int32)  # int32 [num_outputs + 1]
        np.cumsum(np.asarray(self._num_tokens, dtype=np.int32), out=cu_new_tokens[1:])
        outputs = StepOutputs(
            step_id=step_id,
            request_ids=self._request_ids,
            cu_new_tokens=cu_new_tokens,
            new_token_ids=np.array(self._token_ids, dtype=np.int32),  # int32 [total_new_tokens]
            finish_reasons=self._finish_reasons,
            error_messages=self._error_messages,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            num_preemptions_total=stats.num_preemptions_total,
            step_duration_s=step_duration_s,
            wall_time_s=time.time(),
            num_scheduled_tokens=num_scheduled_tokens,
            num_padded_slot_steps_total=stats.num_padded_slot_steps_total,
        )
        self._reset()
        return outputs
