"""Structured output in the engine: matchers for new constrained sequences and each step's bitmask rows.

The GrammarTable (llguidance's token table, about 0.7 s to build on the default model's 49,152
tokens, plus 0.1-0.3 s to import llguidance) is built at the first constrained request, not at
start: the scheduler must start in well under a second, and most deployments never constrain
anything. A background thread at start would not help: building the table holds the GIL, so it
would stall the loop's ready handshake and first steps instead. The price is one pause of about
a second for the first constrained request of a scheduler's life.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from proto.config import EngineConfig
from proto.grammar import GrammarSpec
from proto.messages import AddRequest, GrammarMasks, ResumedOutputs
from scheduler_proc.bad_words import BadWords
from scheduler_proc.choices import resumed_output_tokens
from scheduler_proc.token_set import AllOf, Constraint, TokenSet, allowed_row, bitmask_words

if TYPE_CHECKING:
    from scheduler_proc.grammar import GrammarTable, SequenceGrammar
    from scheduler_proc.request import Request

NO_MASKS = GrammarMasks()  # the plan of a step with no constrained member (frozen, shared)


class Constraints:
    """Owns the GrammarTable (built on first use); sequences own their matchers (Request.grammar)."""

    def __init__(self, config: EngineConfig, table: GrammarTable | None = None) -> None:
        self._config = config
        self._table = table

    @property
    def is_built(self) -> bool:
        return self._table is not None

    def start(self, spec: GrammarSpec, num_choices: int,
              resumed: ResumedOutputs | None = None) -> tuple[list[SequenceGrammar], str]:
        """(one matcher per choice, "") or ([], why the request must end in error): the spec does
        not compile here, or a resubmission's restored output tokens (`resumed`) break it. Each
        unfinished resumed choice's matcher is replayed over the tokens it already has."""
        from scheduler_proc.grammar import GrammarError  # llguidance loads with the first constrained request

        try:
            table = self._table or self._build()
            grammars = [table.start(spec) for _ in range(num_choices)]
        except (GrammarError, OSError, ValueError, RuntimeError) as exc:
            return [], f"structured output is unavailable for this request: {exc}"
        for index, grammar in enumerate(grammars):
            if resumed is None or resumed.finished[index]:
                continue
            try:
                grammar.replay(resumed_output_tokens(resumed, index).tolist())
            except GrammarError as exc:
                return [], f"choice {index}'s resumed output tokens do not match its grammar: {exc}"
        return grammars, ""

    def for_request(self, message: AddRequest) -> tuple[list[Constraint], str]:
        """(each choice's constraint, "") or ([], why the request must end in error): its grammar's
        matcher (start), its allowed_token_ids (a TokenSet, one row shared by the choices), its
        bad_words (BadWords, replayed over a resubmission's tokens), or AllOf of those it has."""
        params, resumed = message.sampling_params, message.resume
        parts: list[list[Constraint]] = [[] for _ in range(params.n)]
        if message.grammar is not None:
            grammars, reason = self.start(message.grammar, params.n, resumed)
            if reason:
                return [], reason
            for choice_parts, grammar in zip(parts, grammars):
                choice_parts.append(grammar)
        vocab_size = self._config.vocab_size
        if vocab_size <= 0 and (params.allowed_token_ids or params.bad_words_token_ids):
            name = "allowed_token_ids" if params.allowed_token_ids else "bad_words"
            return [], f"{name} needs the model's vocabulary size, which this scheduler was not given"
        if params.allowed_token_ids:
            row = allowed_row(params.allowed_token_ids, vocab_size)
            for choice_parts in parts:
                choice_parts.append(TokenSet(row))
        if params.bad_words_token_ids:
            for index, choice_parts in enumerate(parts):
                restored = [] if resumed is None else resumed_output_tokens(resumed, index).tolist()
                bad_words = BadWords(params.bad_words_token_ids, vocab_size, restored)
                if bad_words.error:
                    return [], f"choice {index}'s resumed output tokens hold one of its bad_words: {bad_words.error}"
                choice_parts.append(bad_words)
        return [choice_parts[0] if len(choice_parts) == 1 else AllOf(choice_parts) for choice_parts in parts], ""

    def masks(self, requests: Sequence[Request], rows: Sequence[int]) -> GrammarMasks:
        """The bitmask rows of the constrained sampling members `rows` (indices into `requests`).

        A matcher that fails while computing its mask fails its request (SequenceGrammar.fail,
        and the stop rule ends it with "error" when the step's token comes back); its row allows every token
        meanwhile, so the step itself goes ahead for the whole batch.
        """
        vocab_size = self._table.vocab_size if self._table is not None else self._config.vocab_size
        bitmask = np.empty((len(rows), bitmask_words(vocab_size)), dtype=np.int32)  # int32 [k, words]
        failures = self._failures()
        for index, row in enumerate(rows):
            request = requests[row]
            try:
                request.grammar.fill_row(bitmask[index])
            except failures as exc:
                request.grammar.fail(str(exc))
                bitmask[index] = -1
            if not bitmask[index].any():  # e.g. a grammar whose every continuation is among bad_words
                request.grammar.fail("the request's constraints (grammar, allowed_token_ids, bad_words) "
                                     "leave no token to sample here")
                bitmask[index] = -1
        return GrammarMasks(np.asarray(rows, dtype=np.int32), bitmask.shape[1], bitmask.reshape(-1))

    def _failures(self) -> tuple[type[Exception], ...]:
        """What computing a row may raise: the grammar engine's error once it is loaded (a
        TokenSet's row cannot fail, and needs no engine)."""
        if self._table is None:
            return ()
        from scheduler_proc.grammar import GrammarError

        return (GrammarError,)

    def _build(self) -> GrammarTable:
        from scheduler_proc.grammar import GrammarError, GrammarTable

        config = self._config
        if not config.model or config.vocab_size <= 0:
            raise GrammarError(f"the scheduler knows no model tokenizer (model {config.model!r}, "
                               f"vocab_size {config.vocab_size})")
        self._table = GrammarTable.from_model_dir(config.model, config.vocab_size, list(config.eos_token_ids))
        return self._table
