"""How each plan member samples, as columns: the StepPlan's `sampling` field.

A column named like a SamplingParams field is filled from that field (`param_row`, `from_rows`),
so a new sampling parameter needs only its SamplingParams field, its column here and the
sampler's use of it: the scheduler and the codec handle every such column alike.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from proto.arrays import Float32Array, Int32Array, Int64Array, array_dtype, empty
from proto.sampling import SamplingParams


@dataclass(frozen=True)
class LogitBias:
    """Sparse (row, token, value) logit adjustments (logit_bias, and -inf on stop tokens before
    min_tokens); rows index members."""

    rows: Int32Array = field(default_factory=empty(np.int32))  # [num_biases]
    token_ids: Int32Array = field(default_factory=empty(np.int32))  # [num_biases]
    values: Float32Array = field(default_factory=empty(np.float32))  # [num_biases]


@dataclass(frozen=True)
class PenaltyHistory:
    """Prompt + output tokens of the members whose penalties are active; `token_ids[cu[i]:cu[i+1]]`
    is member i's (empty for the others), its first num_prompt[i] are prompt tokens."""

    cu: Int32Array  # [num_seqs + 1]
    token_ids: Int32Array  # [total_history]
    num_prompt: Int32Array  # [num_seqs]

    @classmethod
    def none(cls, num_seqs: int) -> PenaltyHistory:
        zeros = np.zeros(num_seqs + 1, dtype=np.int32)
        return cls(zeros, np.zeros(0, dtype=np.int32), zeros[:num_seqs])


@dataclass(frozen=True)
class SamplingColumns:
    """Per-member columns [num_seqs] in batch order, then the sparse parts."""

    temperature: Float32Array  # 0 = greedy
    top_p: Float32Array
    top_k: Int32Array  # 0 = off (SamplingParams' -1 travels as 0)
    min_p: Float32Array
    repetition_penalty: Float32Array
    presence_penalty: Float32Array
    frequency_penalty: Float32Array
    logprobs: Int32Array  # top alternatives reported with the sampled token; -1 = none
    seeds: Int64Array  # the scheduler's per-sequence seed (drawn when the request had none)
    bias: LogitBias
    history: PenaltyHistory
    # 0 or num_seqs entries: prompt logprobs owed this step (-1 = none), and the prompt token at
    # position num_computed + num_scheduled when that is a prompt token and one is owed, else -1
    # (see StepResult).
    num_prompt_logprobs: Int32Array = field(default_factory=empty(np.int32))
    next_prompt_token_ids: Int32Array = field(default_factory=empty(np.int32))

    @property
    def num_seqs(self) -> int:
        return len(self.temperature)

    @staticmethod
    def param_row(params: SamplingParams) -> tuple[float, ...]:
        """One member's PARAM_COLUMNS values, in order (all exact in float64)."""
        return tuple(_CANONICAL.get(name, _same)(getattr(params, name)) for name in PARAM_COLUMNS)

    @classmethod
    def from_rows(cls, rows: np.ndarray, seeds: np.ndarray, bias: LogitBias, history: PenaltyHistory,
                  **extra: np.ndarray) -> SamplingColumns:
        """rows: float64 [num_seqs, len(PARAM_COLUMNS)] of param_row values; each column is cast
        to its declared dtype. `extra`: the optional columns."""
        columns = {name: rows[:, index].astype(PARAM_DTYPES[name]) for index, name in enumerate(PARAM_COLUMNS)}
        return cls(seeds=seeds, bias=bias, history=history, **columns, **extra)

    @classmethod
    def of_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int] | None = None) -> SamplingColumns:
        """Members that sample with `params` (seeds: the params' own, 0 where None), no biases
        and no penalty history: for tools and tests."""
        rows = np.array([cls.param_row(p) for p in params], dtype=np.float64).reshape(len(params), -1)
        if seeds is None:
            seeds = [p.seed or 0 for p in params]
        return cls.from_rows(rows, np.asarray(seeds, dtype=np.int64), LogitBias(),
                             PenaltyHistory.none(len(params)))


def _same(value: float) -> float:
    return value


# A parameter with two spellings of one meaning travels as one of them.
_CANONICAL = {"top_k": lambda top_k: max(top_k, 0)}
_PARAM_NAMES = {f.name for f in fields(SamplingParams)}
# The columns filled from the same-named SamplingParams field, in declaration order.
PARAM_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(SamplingColumns) if f.name in _PARAM_NAMES)
PARAM_DTYPES = {name: array_dtype(typing.get_type_hints(SamplingColumns, include_extras=True)[name])
                for name in PARAM_COLUMNS}
