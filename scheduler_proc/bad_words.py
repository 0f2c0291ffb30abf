"""vLLM's bad_words as a constraint: the token that would complete a banned token sequence is masked.

The frontend tokenizes each banned word as vLLM does (as written, and with a leading space where
that makes other tokens of the same count); a one-token word is never sampled, and a longer one's
last token is masked while the sequence's latest output tokens equal the rest of it. Only output
tokens count, not the prompt, as in vLLM. The state is the last few output tokens, advanced by
every token the sequence accepts, so preemption changes nothing and a resubmission replays them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scheduler_proc.token_set import allows, bitmask_words, clear


class BadWords:
    """One sequence's banned token sequences; `error` is set if a banned token comes back anyway
    (a sampler or wiring bug, reported), and it never finishes a sequence by itself."""

    is_finished = False

    def __init__(self, sequences: Sequence[Sequence[int]], vocab_size: int,
                 output_token_ids: Sequence[int] = ()) -> None:
        self._always = np.full(bitmask_words(vocab_size), -1, dtype=np.int32)  # int32 [words]: one-token words cleared
        for token_ids in sequences:
            if len(token_ids) == 1:
                clear(self._always, token_ids[0])
        # Multi-token words by the last token of their prefix: a step looks only at those that the
        # latest output token could continue.
        self._longer: dict[int, list[tuple[tuple[int, ...], int]]] = {}
        for token_ids in sequences:
            if len(token_ids) > 1:
                self._longer.setdefault(token_ids[-2], []).append((tuple(token_ids[:-1]), token_ids[-1]))
        self._window = max((len(t) - 1 for t in sequences), default=0)
        self._recent: list[int] = []  # the last `_window` output tokens
        self.error = ""
        for token_id in output_token_ids:
            self.accept(token_id)

    def banned_next(self) -> list[int]:
        """The tokens that would complete a banned sequence now (one-token words aside)."""
        recent = self._recent
        if not recent:
            return []
        return [last for prefix, last in self._longer.get(recent[-1], ())
                if len(prefix) <= len(recent) and tuple(recent[len(recent) - len(prefix):]) == prefix]

    def accept(self, token_id: int) -> None:
        if not self.error and (not allows(self._always, token_id) or token_id in self.banned_next()):
            self.error = f"token {token_id} completes one of bad_words"
        if self._window:
            self._recent.append(token_id)
            del self._recent[:-self._window]

    def fail(self, error_message: str) -> None:
        self.error = self.error or error_message

    def fill_row(self, row: np.ndarray) -> None:
        """Write the allowed tokens into `row`, int32 [words]."""
        row[:] = self._always
        for token_id in self.banned_next():
            clear(row, token_id)
