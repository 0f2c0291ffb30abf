"""Log probabilities in OpenAI's two response shapes (legacy completions, chat).

The values are log_softmax of the RAW model logits: before logit_bias, penalties, temperature and
top-k/top-p, as vLLM reports them by default. They describe the model, not the sampler: with
temperature 0.7 a sampled token's logprob is still the one at temperature 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from frontend.engine_outputs import TokenLogprob
from frontend.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class CompletionLogprobs:
    """Builds `choices[i].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`.

    `text_offset` counts characters of the token texts from the start of the choice's text (the
    echoed prompt included); one builder per choice keeps it running across stream chunks.
    `top_logprobs[i]` holds the top k and always the token itself (so up to k + 1 entries);
    a token without an entry (the first prompt token) has null logprob and null top.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._text_offset = 0

    def build(self, token_ids: Sequence[int],
              entries: Sequence[TokenLogprob | None]) -> dict[str, list[Any]]:
        text_of = self._tokenizer.token_text
        shape: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                       "text_offset": []}
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = text_of(token_id)
            shape["tokens"].append(text)
            shape["text_offset"].append(self._text_offset)
            self._text_offset += len(text)
            if entry is None:
                shape["token_logprobs"].append(None)
                shape["top_logprobs"].append(None)
                continue
            top = {text_of(top_id): _value(logprob) for top_id, logprob in entry.top}
            top.setdefault(text, _value(entry.logprob))
            shape["token_logprobs"].append(_value(entry.logprob))
            shape["top_logprobs"].append(top)
        return shape


def prompt_entries(prompt_token_ids: Sequence[int],
                   by_position: dict[int, TokenLogprob]) -> list[TokenLogprob | None]:
    """The entry of each prompt token (position 0 never has one: nothing predicts it)."""
    return [by_position.get(position) for position in range(len(prompt_token_ids))]


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int],
                  entries: Sequence[TokenLogprob | None], num_top: int) -> dict[str, Any]:
    """`choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs}]}`, top k each."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        item = _chat_token(tokenizer, token_id, None if entry is None else entry.logprob)
        top = entry.top[:num_top] if entry is not None else ()
        item["top_logprobs"] = [_chat_token(tokenizer, top_id, logprob) for top_id, logprob in top]
        content.append(item)
    return {"content": content}


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float | None) -> dict[str, Any]:
    return {"token": tokenizer.token_text(token_id),
            "logprob": None if logprob is None else _value(logprob),
            "bytes": list(tokenizer.token_bytes(token_id))}
