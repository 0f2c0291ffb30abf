"""Per-sequence plan constants (sampling parameters, seed, logprob count) as numpy rows, so a plan
gathers them for the whole batch with one index instead of building a tuple per member."""

from __future__ import annotations

import numpy as np

from scheduler_proc.request import Request

COLUMNS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "num_logprobs", "has_bias", "has_penalties")
COLUMN = {name: index for index, name in enumerate(COLUMNS)}
# What a static batch's padding seat samples with: greedy, no penalties, no logprobs.
PADDING_ROW = (0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, -1.0, 0.0, 0.0)


class PlanConstants:
    """A row per live sequence (its `slot`), written once when it is added and freed when it
    finishes. All values fit float64 exactly; seeds (int64) live in their own array."""

    def __init__(self, capacity: int = 64) -> None:
        self._values = np.zeros((capacity, len(COLUMNS)), dtype=np.float64)  # float64 [capacity, columns]
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
        self._values[slot] = (params.temperature, params.top_p, max(params.top_k, 0), params.min_p,
                              params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
                              params.logprobs, has_bias, params.has_penalties)
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
