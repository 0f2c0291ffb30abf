"""allowed_token_ids as a constraint: one constant bitmask row that the sequence samples under at every step.

A TokenSet takes a grammar's place on the Request (Request.grammar), so the batch's constrained
rows, the plan's mask rows (Constraints.masks) and the stop rule treat both alike; it needs no
grammar engine. Bit t of a row (word t // 32, bit t % 32, little-endian) is 1 when token t is
allowed, the layout of scheduler_proc/grammar.py and worker_proc/grammar_mask.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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


class TokenSet:
    """One sequence's constant set of allowed tokens (the row is shared by the request's choices).

    It never finishes a sequence by itself; `error` is set only if a token outside the set comes
    back, which the mask should have made impossible (a sampler or wiring bug, reported)."""

    is_finished = False  # as SequenceGrammar.is_finished: nothing forces the sequence to end

    def __init__(self, row: np.ndarray) -> None:
        self._row = row  # int32 [words], read-only
        self.error = ""

    def allows(self, token_id: int) -> bool:
        return 0 <= token_id < len(self._row) * 32 and bool((int(self._row[token_id >> 5]) >> (token_id & 31)) & 1)

    def accept(self, token_id: int) -> None:
        if not self.error and not self.allows(token_id):
            self.error = f"token {token_id} was sampled outside allowed_token_ids"

    def fail(self, error_message: str) -> None:
        self.error = self.error or error_message

    def fill_row(self, row: np.ndarray) -> None:
        """Write the allowed tokens into `row`, int32 [words]."""
        row[:] = self._row
