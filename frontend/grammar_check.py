"""Compile-check a GrammarSpec in the frontend, so that a grammar that cannot compile never queues.

The check is the scheduler's own compile (the same llguidance grammar text from
proto.grammar.engine_grammar, against the same tokenizer.json), so what passes here compiles
there. Results are cached by spec: a client that sends one schema many times pays once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from http import HTTPStatus
from threading import Lock, Thread

import llguidance

from frontend.errors import APIError, bad_request
from frontend.tokenizer import Tokenizer
from proto.grammar import GrammarSpec, engine_grammar

MAX_CACHED_CHECKS = 1024
# The error code of a schema keyword the engine does not implement; its message names the
# keywords ("Unimplemented keys: [...]") so the client knows what to drop.
_UNSUPPORTED = "unsupported_schema_feature"


class GrammarChecker:
    """Owns the frontend's llguidance token table (built once, about 0.5 s on a 49k vocabulary)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=list(eos_token_ids))
        self._errors: OrderedDict[GrammarSpec, str] = OrderedDict()
        self._lock = Lock()  # requests are prepared on worker threads

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int,
                      eos_token_ids: tuple[int, ...]) -> "GrammarChecker":
        """The model's vocab_size and eos_token_ids (EngineConfig's), as the scheduler's table has."""
        return cls(tokenizer.backend_json(), vocab_size, list(eos_token_ids))

    def check(self, spec: GrammarSpec, param: str) -> None:
        """400 naming `param` and the engine's reason when `spec` does not compile."""
        error = self._error(spec)
        if error:
            code = _UNSUPPORTED if error.startswith("Unimplemented keys") else "invalid_grammar"
            what = "schema" if spec.kind in ("json_schema", "json_object") else spec.kind
            raise bad_request(f"{param}: the {what} cannot be used: {error}", param, code)

    def _error(self, spec: GrammarSpec) -> str:
        with self._lock:
            if spec in self._errors:
                self._errors.move_to_end(spec)
                return self._errors[spec]
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            engine_grammar(spec), self._tokenizer)
        error = _first_line(messages[0]) if is_error and messages else ""
        with self._lock:
            self._errors[spec] = error
            if len(self._errors) > MAX_CACHED_CHECKS:
                self._errors.popitem(last=False)
        return error


class BackgroundGrammarChecker:
    """A GrammarChecker built on a thread from the moment the frontend starts (0.4-1.4 s on a 49k
    vocabulary), so startup does not wait for it; the first constrained request waits instead.
    `check` is GrammarChecker's, and is called from the prepare threads, never the event loop."""

    def __init__(self, build: Callable[[], GrammarChecker]) -> None:
        self._checker: Future[GrammarChecker] = Future()
        Thread(target=self._build, args=(build,), name="grammar-checker", daemon=True).start()

    def _build(self, build: Callable[[], GrammarChecker]) -> None:
        try:
            self._checker.set_result(build())
        except Exception as exc:  # the tokenizer llguidance cannot read: constrained requests say so
            self._checker.set_exception(exc)

    def check(self, spec: GrammarSpec, param: str) -> None:
        try:
            checker = self._checker.result()
        except Exception as exc:
            raise APIError(HTTPStatus.BAD_REQUEST, f"{param}: structured output is not available for "
                           f"this model: the grammar engine cannot use its tokenizer ({exc})",
                           "invalid_request_error", param, "structured_output_unavailable") from None
        checker.check(spec, param)


GrammarCheck = GrammarChecker | BackgroundGrammarChecker  # what validation asks to `check` a spec


def _first_line(message: str) -> str:
    """The engine's reason without its source excerpt (a regex error keeps its caret lines)."""
    return " ".join(line.strip() for line in message.split("\n   1 |")[0].splitlines() if line.strip())
