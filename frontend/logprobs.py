"""Log probabilities in OpenAI's two response shapes (legacy completions, chat).

The values are log_softmax of the RAW model logits: before logit_bias, penalties, temperature and
top-k/top-p, as vLLM reports them by default. They describe the model, not the sampler: with
temperature 0.7 a sampled token's logprob is still the one at temperature 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from frontend.engine_outputs import TokenLogprob
from frontend.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def token_namer(tokenizer: Tokenizer, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids,
    for tokens whose bytes are not text on their own)."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else tokenizer.token_text


class CompletionLogprobs:
    """Builds `choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`.

    `text_offset` counts characters of the token texts from the start of the choice's text (the
    echoed prompt included); one builder per choice keeps it running across stream chunks.
    `top_logprobs[i]` holds the top k and always the token itself (so up to k + 1 entries);
    a token without an entry (the first prompt token) has null logprob and null top.
    """

    def __init__(self, tokenizer: Tokenizer, tokens_as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._name_of = token_namer(tokenizer, tokens_as_ids)
        self._text_offset = 0

    def build(self, token_ids: Sequence[int],
              entries: Sequence[TokenLogprob | None]) -> dict[str, list[Any]]:
        name_of = self._name_of
        shape: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                       "text_offset": []}
        for token_id, entry in zip(token_ids, entries, strict=True):
            name = name_of(token_id)
            shape["tokens"].append(name)
            shape["text_offset"].append(self._text_offset)  # of the text, however tokens are named
            self._text_offset += len(self._tokenizer.token_text(token_id))
            if entry is None:
                shape["token_logprobs"].append(None)
                shape["top_logprobs"].append(None)
                continue
            top = {name_of(top_id): _value(logprob) for top_id, logprob in entry.top}
            top.setdefault(name, _value(entry.logprob))
            shape["token_logprobs"].append(_value(entry.logprob))
            shape["top_logprobs"].append(top)
        return shape


def prompt_entries(prompt_token_ids: Sequence[int], by_position: dict[int, TokenLogprob],
                   num_top: int) -> list[TokenLogprob | None]:
    """The entry of each prompt token with its top `num_top` (position 0 never has one: nothing
    predicts it); the entries may hold more (prompt_logprobs asked for more than echo's logprobs)."""
    entries = [by_position.get(position) for position in range(len(prompt_token_ids))]
    num_top = max(num_top, 0)
    return [entry if entry is None or len(entry.top) <= num_top else dataclasses.replace(entry, top=entry.top[:num_top])
            for entry in entries]


def vllm_prompt_logprobs(tokenizer: Tokenizer, prompt_token_ids: Sequence[int], by_position: dict[int, TokenLogprob],
                         num_top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first (nothing predicts it), else
    {token id: {logprob, rank, decoded_token}} for the token itself, then its top `num_top` (ranks
    1..num_top). As in vLLM, a token among its own top takes that entry's rank: its key stays first."""
    shape: list[dict[str, dict[str, Any]] | None] = []
    for entry in prompt_entries(prompt_token_ids, by_position, num_top):
        if entry is None:
            shape.append(None)
            continue
        tokens = {str(entry.token_id): _vllm_logprob(tokenizer, entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            tokens[str(token_id)] = _vllm_logprob(tokenizer, token_id, logprob, rank)
        shape.append(tokens)
    return shape


def _vllm_logprob(tokenizer: Tokenizer, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": _value(logprob), "rank": rank, "decoded_token": tokenizer.token_text(token_id)}


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int],
                  entries: Sequence[TokenLogprob | None], num_top: int, tokens_as_ids: bool = False) -> dict[str, Any]:
    """`choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs}]}`, top k each;
    `bytes` are the token's own either way."""
    name_of = token_namer(tokenizer, tokens_as_ids)
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        item = _chat_token(tokenizer, name_of, token_id, None if entry is None else entry.logprob)
        top = entry.top[:num_top] if entry is not None else ()
        item["top_logprobs"] = [_chat_token(tokenizer, name_of, top_id, logprob) for top_id, logprob in top]
        content.append(item)
    return {"content": content}


def _chat_token(tokenizer: Tokenizer, name_of: Callable[[int], str], token_id: int,
                logprob: float | None) -> dict[str, Any]:
    return {"token": name_of(token_id),
            "logprob": None if logprob is None else _value(logprob),
            "bytes": list(tokenizer.token_bytes(token_id))}
