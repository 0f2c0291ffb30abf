"""Per-sequence plan constants (the sampling columns named like SamplingParams fields, plus two
flags) as numpy rows, so a plan gathers them for the whole batch with one index instead of
building a tuple per member."""

from __future__ import annotations

import numpy as np

from proto.sampling import SamplingParams
from proto.sampling_columns import PARAM_COLUMNS, SamplingColumns
from scheduler_proc.request import Request

NUM_PARAMS = len(PARAM_COLUMNS)  # the first NUM_PARAMS columns: SamplingColumns.param_row
HAS_BIAS, HAS_PENALTIES = NUM_PARAMS, NUM_PARAMS + 1  # then the scheduler's own flags
# What a static batch's padding seat samples with: greedy, no penalties, no logprobs.
PADDING_ROW = (*SamplingColumns.param_row(SamplingParams(temperature=0.0)), 0.0, 0.0)


class PlanConstants:
    """A row per live sequence (its `slot`), written once when it is added and freed when it
    finishes. All values fit float64 exactly; seeds (int64) live in their own array."""

    def __init__(self, capacity: int = 64) -> None:
        self._values = np.zeros((capacity, NUM_PARAMS + 2), dtype=np.float64)  # float64 [capacity, columns]
        self._seeds = np.zeros(capacity, dtype=np.int64)  # int64 [capacity]
        self._free_slots = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest

    @property
    def num_live(self) -> int:
        return len(self._values) - len(self._free_slots)

    def assign(self, request: Request) -> None:
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        params = request.sampling_params
        has_bias = bool(params.logit_bias) or len(request.min_tokens_logit_bias.token_ids) > 0
        self._values[slot] = (*SamplingColumns.param_row(params), has_bias, params.has_penalties)
        self._seeds[slot] = request.seed
        request.attach_plan_row(slot)

    def release(self, request: Request) -> None:
        self._free_slots.append(request.detach_plan_row())

    def gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(float64 [n, columns], int64 [n]) for int64 [n] slots."""
        return self._values[slots], self._seeds[slots]

    def _grow(self) -> None:
        capacity = len(self._values)
        self._values = np.concatenate([self._values, np.zeros_like(self._values)])
        self._seeds = np.concatenate([self._seeds, np.zeros_like(self._seeds)])
        self._free_slots.extend(range(2 * capacity - 1, capacity - 1, -1))
