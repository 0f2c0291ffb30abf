"""A request's sampling fields -> SamplingParams: what passes through, logit_bias keys, bad_words, stop strings."""

from __future__ import annotations

import dataclasses
from typing import Any

from frontend.errors import bad_request, from_validation_error
from frontend.protocol import SamplingFields
from frontend.tokenizer import Tokenizer
from proto.errors import ValidationError
from proto.sampling import DEFAULTS, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, SamplingParams, check_vocab_bounds

# OpenAI allows 4 stop strings; vLLM has no limit. 16 keeps the per-token partial-match scan cheap.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512

# SamplingParams fields that the HTTP request model carries under the same name and meaning, as they
# come (None: left out); the others are built below. A new sampling parameter needs no line here.
PASSED_THROUGH = tuple(f.name for f in dataclasses.fields(SamplingParams)
                       if f.name in SamplingFields.model_fields and f.name not in (
                           "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids", "logit_bias",
                           "allowed_token_ids", "logprobs", "prompt_logprobs"))


def sampling_params(request: SamplingFields, max_tokens: int, vocab_size: int,
                     logprob_fields: dict[str, int],
                     bad_words_token_ids: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
    """Fields the client left out (None) take SamplingParams' defaults. The vocabulary bounds
    come first, so a huge top_k is told the vocabulary size rather than int32's."""
    given = {name: getattr(request, name) for name in PASSED_THROUGH}
    stop_token_ids = tuple(request.stop_token_ids or ())
    logit_bias = logit_bias_entries(request.logit_bias, vocab_size)
    if request.allowed_token_ids == []:
        raise bad_request("allowed_token_ids must not be empty (leave it out to allow every token)",
                          "allowed_token_ids")
    allowed_token_ids = tuple(dict.fromkeys(request.allowed_token_ids or ()))  # repeats dropped: fewer to carry
    if len(allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:  # before the vocabulary check reads them all
        raise bad_request(f"at most {MAX_ALLOWED_TOKEN_IDS} allowed_token_ids are allowed, got "
                          f"{len(allowed_token_ids)}", "allowed_token_ids")
    try:
        check_vocab_bounds(vocab_size, or_default(request.top_k, DEFAULTS.top_k), stop_token_ids,
                           [token_id for token_id, _ in logit_bias], allowed_token_ids, bad_words_token_ids)
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=request.min_tokens, ignore_eos=request.ignore_eos,
            stop_token_ids=stop_token_ids, logit_bias=logit_bias, allowed_token_ids=allowed_token_ids,
            bad_words_token_ids=bad_words_token_ids, **logprob_fields,
            **{name: value for name, value in given.items() if value is not None})
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def bad_words_token_ids(words: list[str] | None, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's reading of bad_words: each word's tokens as written (leading space stripped), and
    also with one leading space where that gives as many tokens, starting with another one (the
    word in mid-text). A 400 for an empty word."""
    if words and len(words) > MAX_BAD_WORDS // 2:  # each may give two sequences
        raise bad_request(f"at most {MAX_BAD_WORDS // 2} bad_words are allowed, got {len(words)}", "bad_words")
    sequences: list[tuple[int, ...]] = []
    for word in words or ():
        if not word.strip():
            raise bad_request("bad_words must not hold an empty word", "bad_words")
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if spaced[:1] != alone[:1] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)


def logit_bias_entries(logit_bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """JSON keys are strings: each must spell a token id in ASCII digits ("²" and "-1" do not)."""
    entries = []
    for key, bias in (logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias")
        if len(key.lstrip("0")) > len(str(vocab_size)):  # also spares int() a 4300-digit string
            raise bad_request(f"logit_bias token id {key[:40]} is out of range for a vocabulary "
                              f"of {vocab_size}", "logit_bias")
        entries.append((int(key), bias))
    return tuple(entries)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", "stop")
    for text in stops:
        if not text:
            raise bad_request("stop strings must not be empty", "stop")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise bad_request(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, "
                              f"got {len(text)}", "stop")
    return stops


def or_default(value: Any, default: Any) -> Any:
    """`value`, or `default` where the client left it out (None)."""
    return default if value is None else value
