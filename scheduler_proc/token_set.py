"""allowed_token_ids as a constraint (one constant bitmask row), and AllOf, a sequence's constraints at once.

A constraint sits on Request.grammar: a grammar's matcher (scheduler_proc/grammar.py), a TokenSet,
BadWords (scheduler_proc/bad_words.py), or AllOf of several. Each has `error`, `is_finished`,
`accept(token_id)`, `fail(message)` and `fill_row(row)`, so the batch's constrained rows, the
plan's mask rows (Constraints.masks) and the stop rule treat them alike. Bit t of a row (word
t // 32, bit t % 32, little-endian) is 1 when token t is allowed, the layout of
scheduler_proc/grammar.py and worker_proc/grammar_mask.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Constraint(Protocol):
    """What Request.grammar holds (a grammar's matcher, TokenSet, BadWords or AllOf)."""

    @property
    def error(self) -> str: ...  # set once a token breaks it (or a row could not be computed)

    @property
    def is_finished(self) -> bool: ...  # nothing but the end may follow

    def accept(self, token_id: int) -> None: ...

    def fail(self, error_message: str) -> None: ...

    def fill_row(self, row: np.ndarray) -> None: ...  # int32 [words], C-contiguous


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one mask row over a vocabulary of vocab_size."""
    return -(-vocab_size // 32)


def allowed_row(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """int32 [bitmask_words(vocab_size)]: exactly `token_ids` allowed (each < vocab_size)."""
    bits = np.zeros(bitmask_words(vocab_size) * 32, dtype=np.bool_)  # bool [words * 32]
    bits[np.asarray(token_ids, dtype=np.int64)] = True
    row = np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)  # int32 [words]
    row.flags.writeable = False  # shared by every choice of the request
    return row


def allows(row: np.ndarray, token_id: int) -> bool:
    """Whether `row` (int32 [words]) has token_id's bit set."""
    return 0 <= token_id < len(row) * 32 and bool((int(row.view(np.uint32)[token_id >> 5]) >> (token_id & 31)) & 1)


def clear(row: np.ndarray, token_id: int) -> None:
    """Clear token_id's bit in `row` (int32 [words]), in place."""
    words = row.view(np.uint32)
    words[token_id >> 5] &= np.uint32(~(1 << (token_id & 31)) & 0xFFFFFFFF)


class TokenSet:
    """One sequence's constant set of allowed tokens (the row is shared by the request's choices).

    It never finishes a sequence by itself; `error` is set only if a token outside the set comes
    back, which the mask should have made impossible (a sampler or wiring bug, reported)."""

    is_finished = False  # as SequenceGrammar.is_finished: nothing forces the sequence to end

    def __init__(self, row: np.ndarray) -> None:
        self._row = row  # int32 [words], read-only
        self.error = ""

    def allows(self, token_id: int) -> bool:
        return allows(self._row, token_id)

    def accept(self, token_id: int) -> None:
        if not self.error and not self.allows(token_id):
            self.error = f"token {token_id} was sampled outside allowed_token_ids"

    def fail(self, error_message: str) -> None:
        self.error = self.error or error_message

    def fill_row(self, row: np.ndarray) -> None:
        """Write the allowed tokens into `row`, int32 [words]."""
        row[:] = self._row


class AllOf:
    """Several constraints of one sequence: a token is allowed where every one allows it (rows
    ANDed); it finishes when any part does (a grammar that can only end), fails when any fails."""

    def __init__(self, parts: Sequence[Constraint]) -> None:
        self._parts = list(parts)

    @property
    def error(self) -> str:
        return next((part.error for part in self._parts if part.error), "")

    @property
    def is_finished(self) -> bool:
        return any(part.is_finished for part in self._parts)

    def accept(self, token_id: int) -> None:
        for part in self._parts:
            part.accept(token_id)

    def fail(self, error_message: str) -> None:
        self._parts[0].fail(error_message)

    def fill_row(self, row: np.ndarray) -> None:
        self._parts[0].fill_row(row)
        other = np.empty_like(row)  # int32 [words]
        for part in self._parts[1:]:
            part.fill_row(other)
            row &= other
