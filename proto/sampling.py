"""Per-request sampling and stopping parameters: their defaults, ranges and validation (on construction)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from proto.errors import ValidationError

MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary conveyor serves (and each id is checked against it)
MAX_BAD_WORDS = 256  # token sequences (a word may give two: with and without a leading space)
MAX_BAD_WORD_TOKENS = 64
MAX_N = 16
MAX_LOGPROBS = 20
MAX_INT32 = 2**31 - 1
# Closed ranges the fields must lie in; the HTTP schema states these same ones to clients.
RANGES = {"temperature": (0.0, 100.0), "min_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
          "frequency_penalty": (-2.0, 2.0), "logit_bias": (-100.0, 100.0), "seed": (-(2**63), 2**63 - 1)}
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty is in (0, this]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens and when it stops (on token ids; stop strings live in the frontend).

    temperature 0 means greedy. `seed` None means "the scheduler picks one": noise is always
    derived from (seed, position, token id), so a row never depends on its batch-mates.
    """

    max_tokens: int = 16  # OpenAI's documented default for /v1/completions
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # vLLM's allowed_token_ids: every sampled token is one of these; () = any token. The scheduler
    # turns them into a constant mask row (scheduler_proc/token_set.py), as it does a grammar.
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words as the frontend tokenized them: no output ends with one of these sequences.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    n: int = 1  # choices; the scheduler runs them as sibling sequences sharing the prompt's blocks
    logprobs: int = -1  # -1 = none; k >= 0 = the sampled token's logprob plus the top k
    prompt_logprobs: int = -1  # -1 = none; k >= 0 = each prompt token's logprob plus the top k

    def __post_init__(self) -> None:
        self.validate()

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self) -> None:
        """Raise ValidationError naming the field, the limit and the value. Construction runs it,
        so the frontend's SamplingParams and every decoded one are checked exactly once; what
        needs the vocabulary is `check_vocab`'s."""
        _check_type("max_tokens", self.max_tokens, int)
        _check_range("max_tokens", self.max_tokens, 1, None)
        _check_type("temperature", self.temperature, float)
        _check_range("temperature", self.temperature, *RANGES["temperature"])
        _check_type("top_p", self.top_p, float)
        if not 0.0 < self.top_p <= 1.0:
            raise ValidationError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        check_top_k(self.top_k, None)
        _check_type("min_p", self.min_p, float)
        _check_range("min_p", self.min_p, *RANGES["min_p"])
        _check_type("repetition_penalty", self.repetition_penalty, float)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValidationError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                f"{self.repetition_penalty}",
                "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_type(name, getattr(self, name), float)
            _check_range(name, getattr(self, name), *RANGES[name])
        if self.seed is not None:
            _check_type("seed", self.seed, int)
            _check_range("seed", self.seed, *RANGES["seed"])
        _check_type("min_tokens", self.min_tokens, int)
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise ValidationError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}", "ignore_eos")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValidationError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}",
                "stop_token_ids")
        _check_token_ids("stop_token_ids", self.stop_token_ids, None)
        _check_type("n", self.n, int)
        _check_range("n", self.n, 1, MAX_N)
        for name in ("logprobs", "prompt_logprobs"):
            _check_type(name, getattr(self, name), int)
            _check_range(name, getattr(self, name), -1, MAX_LOGPROBS)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValidationError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}",
                "logit_bias")
        for token_id, bias in self.logit_bias:
            _check_token_id("logit_bias", token_id, None)
            _check_type("logit_bias", bias, float)
            _check_range("logit_bias", bias, *RANGES["logit_bias"])
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise ValidationError(f"at most {MAX_ALLOWED_TOKEN_IDS} allowed_token_ids are allowed, got "
                                  f"{len(self.allowed_token_ids)}", "allowed_token_ids")
        _check_token_ids("allowed_token_ids", self.allowed_token_ids, None)
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            raise ValidationError(f"bad_words may give at most {MAX_BAD_WORDS} token sequences, got "
                                  f"{len(self.bad_words_token_ids)}", "bad_words")
        for token_ids in self.bad_words_token_ids:
            if not 1 <= len(token_ids) <= MAX_BAD_WORD_TOKENS:
                raise ValidationError(f"each of bad_words must be 1 to {MAX_BAD_WORD_TOKENS} tokens long, "
                                      f"got {len(token_ids)}", "bad_words")
            _check_token_ids("bad_words", token_ids, None)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValidationError when top_k or a token id is beyond a vocabulary of vocab_size."""
        check_vocab_bounds(vocab_size, self.top_k, self.stop_token_ids,
                           [token_id for token_id, _ in self.logit_bias], self.allowed_token_ids,
                           self.bad_words_token_ids)


def check_vocab_bounds(vocab_size: int, top_k: object, stop_token_ids: Iterable[object],
                       logit_bias_token_ids: Iterable[object], allowed_token_ids: Iterable[object] = (),
                       bad_words_token_ids: Iterable[Iterable[object]] = ()) -> None:
    """The checks that need the model's vocabulary (a decoder does not know it): top_k at most
    the vocabulary, every token id inside it."""
    check_top_k(top_k, vocab_size)
    _check_token_ids("stop_token_ids", stop_token_ids, vocab_size)
    _check_token_ids("logit_bias", logit_bias_token_ids, vocab_size)
    _check_token_ids("allowed_token_ids", allowed_token_ids, vocab_size)
    for token_ids in bad_words_token_ids:
        _check_token_ids("bad_words", token_ids, vocab_size)


def _check_type(name: str, value: object, kind: type) -> None:
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ValidationError(f"{name} must be of type {kind.__name__}, got {value!r}", name)


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if value != value:  # NaN
        raise ValidationError(f"{name} must be a number, got NaN", name)
    if low is not None and value < low:
        raise ValidationError(f"{name} must be >= {low}, got {value}", name)
    if high is not None and value > high:
        raise ValidationError(f"{name} must be <= {high}, got {value}", name)


def check_top_k(top_k: object, vocab_size: int | None) -> None:
    """-1 or 0 turn it off; above that at most the vocabulary (the plan carries it as int32)."""
    _check_type("top_k", top_k, int)
    limit, what = (vocab_size, "the vocabulary size") if vocab_size else (MAX_INT32, "int32")
    if not -1 <= top_k <= limit:
        raise ValidationError(f"top_k must be -1 or 0 (disabled) or in [1, {limit}] ({what}), "
                              f"got {top_k}", "top_k")


def _check_token_ids(name: str, token_ids: Iterable[object], vocab_size: int | None) -> None:
    """_check_token_id of each, at C speed when all pass (allowed_token_ids may list a whole vocabulary)."""
    token_ids = tuple(token_ids)
    if all(type(token_id) is int for token_id in token_ids) and (
            not token_ids or (min(token_ids) >= 0 and (vocab_size is None or max(token_ids) < vocab_size))):
        return
    for token_id in token_ids:
        _check_token_id(name, token_id, vocab_size)


def _check_token_id(name: str, token_id: object, vocab_size: int | None) -> None:
    if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
        raise ValidationError(f"{name} token ids must be non-negative integers, got {token_id!r}", name)
    if vocab_size is not None and token_id >= vocab_size:
        raise ValidationError(
            f"{name} token id {token_id} is out of range for a vocabulary of {vocab_size}", name)


# Every sampling default lives in SamplingParams; the HTTP models and the frontend's request
# mapping read them here instead of writing them again.
DEFAULTS = SamplingParams()
