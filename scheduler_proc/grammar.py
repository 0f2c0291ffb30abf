"""Grammar state of constrained sequences: compiled grammars, per-sequence matchers, bitmask rows.

The scheduler owns it because it owns the token ids: a matcher advances on every token the
sequence accepts, so preemption and recompute change nothing (the tokens stay), and a rebuilt
scheduler replays each sequence's output tokens into a fresh matcher. The engine is llguidance
(docs/architecture.md, "Structured output"): it needs no torch and no transformers, and builds
its token table from tokenizer.json itself.

Bit t of row r (word t // 32, bit t % 32, little-endian) is 1 when token t is allowed; EOS is
allowed exactly when the grammar accepts the output so far.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import llguidance
import numpy as np

from proto.grammar import GrammarSpec, engine_grammar
from scheduler_proc.token_set import bitmask_words

MAX_CACHED_GRAMMARS = 256


class GrammarError(Exception):
    """A grammar that does not compile, or a token its matcher rejects; the request ends in `error`."""


def _reason(engine_error: str) -> str:
    """The engine's one-line reason; its error text may append a dump of the parser state."""
    for line in engine_error.splitlines():
        if line.startswith("Error: "):
            return line.removeprefix("Error: ")
    return engine_error.split("\n<state>")[0][:500]


class SequenceGrammar:
    """One sequence's position in its grammar, advanced only by tokens the sequence accepted."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self.num_consumed_tokens = 0
        self.error = ""  # set once by accept or fail: the sequence ends with "error" (stop.stop_reason)

    def advance(self, token_id: int) -> None:
        """Consume one accepted token; GrammarError when the grammar rejects it (the mask should
        have made that impossible, so it means a sampler or wiring bug, reported, not hidden)."""
        if not self._matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} at output position {self.num_consumed_tokens} "
                               f"violates the grammar: {_reason(self._matcher.get_error())}")
        self.num_consumed_tokens += 1

    def accept(self, token_id: int) -> None:
        """advance from the Request's transition: a GrammarError is recorded in `error`, not
        raised, and once failed the matcher consumes nothing more."""
        if self.error:
            return
        try:
            self.advance(token_id)
        except GrammarError as exc:
            self.error = str(exc)

    def fail(self, error_message: str) -> None:
        """The matcher failed outside advance (computing a mask)."""
        self.error = self.error or error_message

    def replay(self, token_ids: list[int]) -> None:
        """Advance over a sequence's output tokens, e.g. after a scheduler restart."""
        for token_id in token_ids:
            self.advance(token_id)

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS can follow (or EOS was consumed): the sequence can stop without sampling."""
        return self._matcher.is_stopped()

    def fill_row(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row`, int32 [bitmask_words(vocab_size)], C-contiguous."""
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"]
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed while computing its mask: "
                               f"{_reason(self._matcher.get_error())}")


class GrammarTable:
    """The token table and an LRU cache of compiled grammars keyed by spec.

    A cached grammar is a matcher at its start, never advanced; a new sequence gets a deep copy
    (about 20 us for a typical schema against about 1 ms to compile it on this vocabulary).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        # vocab_size is the model's (the logits' width); ids beyond the tokenizer are never allowed.
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=list(eos_token_ids))
        self._compiled: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab_size: int,
                       eos_token_ids: list[int]) -> "GrammarTable":
        return cls((Path(model_dir) / "tokenizer.json").read_text(), vocab_size, eos_token_ids)

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    def start(self, spec: GrammarSpec) -> SequenceGrammar:
        """A matcher at the start of `spec`'s grammar; GrammarError saying why it does not compile."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._tokenizer, engine_grammar(spec), log_level=0)
            if compiled.is_error():
                raise GrammarError(f"the {spec.kind} grammar does not compile: "
                                   f"{_reason(compiled.get_error())}")
            self._compiled[spec] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return SequenceGrammar(compiled.deep_copy())

    def resume(self, spec: GrammarSpec, output_token_ids: list[int]) -> SequenceGrammar:
        """A matcher rebuilt from a sequence's output tokens (scheduler restart, recovery)."""
        grammar = self.start(spec)
        grammar.replay(output_token_ids)
        return grammar

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        return np.zeros((num_rows, bitmask_words(self.vocab_size)), dtype=np.int32)


def fill_bitmask(grammars: list[SequenceGrammar], bitmask: np.ndarray) -> np.ndarray:
    """Row i of `bitmask` (int32 [>= len(grammars), words]) gets grammars[i]'s allowed tokens.

    Returns the filled rows, int32 [len(grammars), words]: the constrained rows of one step, in
    the order the plan lists its constrained members.
    """
    assert bitmask.ndim == 2 and bitmask.shape[0] >= len(grammars)
    for row, grammar in enumerate(grammars):
        grammar.fill_row(bitmask[row])
    return bitmask[:len(grammars)]
