"""OpenAI request bodies (plus vLLM's sampling extensions) as strict pydantic models."""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from frontend.errors import APIError, describe_pydantic_errors


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1 is not a bool; unknown fields are ignored as OpenAI does.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None


class CompletionRequest(SamplingFields):
    # Any: the allowed shapes (text, token ids, a batch of one) get one precise message in prompts.py.
    prompt: Any = None
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = None


class ChatMessage(BaseModel):
    """Extra keys (name, tool_calls, ...) are kept: chat templates may read them. Content parts
    stay dicts here; validation.py accepts text parts only, with a message naming the part."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Validate a request body whatever its content type (curl -d sends form-encoded JSON)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise describe_pydantic_errors(exc.errors()) from None
