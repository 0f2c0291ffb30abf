"""OpenAI request bodies (plus vLLM's sampling extensions) as strict pydantic models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from frontend.errors import APIError, describe_pydantic_errors
from proto.sampling import (
    DEFAULTS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_STOP_TOKEN_IDS,
    RANGES,
)


# A completions batch runs its prompts side by side; this bounds what one request may queue.
MAX_BATCH_SEQUENCES = 256


class _Strict(BaseModel):
    # strict: "0.5" is not a number and 1 is not a bool; unknown fields are ignored as OpenAI does.
    model_config = ConfigDict(strict=True, extra="ignore")


def _whole_float_as_int(value: Any) -> Any:
    """10.0 -> 10 (what Python clients send after float arithmetic, and vLLM takes); any other
    value goes on to strict validation unchanged, so 10.5, "10" and true stay errors."""
    return int(value) if type(value) is float and value.is_integer() else value


Count = Annotated[int, BeforeValidator(_whole_float_as_int)]  # an integer field that takes 10.0 too


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far as well


class ResponseFormat(_Strict):
    """OpenAI's output format switch; frontend/structured_output.py turns it into a GrammarSpec."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of json, regex, choice, grammar, json_object.

    The other keys are vLLM's backend hints, accepted and ignored: conveyor's JSON grammar never
    lets free whitespace in (proto/grammar.py), whatever they say.
    """

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: Any = Field(default=None, alias="json")  # a schema (object or bool) or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    json_object: bool | None = None
    structural_tag: str | None = None  # refused with a 400: not supported
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


def _documented(default: Any = None, **schema: Any) -> Any:
    """A field whose limits the schema states for clients and fuzzers; SamplingParams.validate()
    and validation.py enforce them, with messages that name the limit and the value."""
    return Field(default=default, json_schema_extra=schema)


def _in_range(name: str) -> Any:
    """An optional field documented with SamplingParams' range for it (proto.sampling.RANGES)."""
    low, high = RANGES[name]
    return _documented(minimum=low, maximum=high)


class SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions. None means "not sent": the
    request then gets SamplingParams' default (proto.sampling.DEFAULTS, the one place they live)."""

    model: str | None = None
    max_tokens: Count | None = _documented(minimum=1)
    temperature: float | None = _in_range("temperature")
    top_p: float | None = _documented(exclusiveMinimum=0, maximum=1)
    n: Count | None = _documented(minimum=1, maximum=MAX_N)
    best_of: Count | None = None
    stop: str | list[str] | None = None
    seed: Count | None = _in_range("seed")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = _in_range("presence_penalty")
    frequency_penalty: float | None = _in_range("frequency_penalty")
    logit_bias: dict[str, float] | None = _documented(
        maxProperties=MAX_LOGIT_BIAS_ENTRIES, propertyNames={"pattern": "^[0-9]{1,9}$"},
        additionalProperties={"type": "number", "minimum": RANGES["logit_bias"][0],
                              "maximum": RANGES["logit_bias"][1]})
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None  # vLLM's older names for structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    ignore_eos: bool = DEFAULTS.ignore_eos
    include_stop_str_in_output: bool = False  # the matched stop string (or stop token's text) stays
    min_tokens: Count = _documented(DEFAULTS.min_tokens, minimum=0)
    top_k: Count | None = _documented(minimum=-1)  # at most the vocabulary size
    min_p: float | None = _in_range("min_p")
    repetition_penalty: float | None = _documented(exclusiveMinimum=0, maximum=MAX_REPETITION_PENALTY)
    stop_token_ids: list[int] | None = _documented(maxItems=MAX_STOP_TOKEN_IDS,
                                                   items={"type": "integer", "minimum": 0})
    skip_special_tokens: bool = True  # False: special tokens' text stays in the output text
    # Taken, changing nothing: the fast tokenizer's decode (the only kind conveyor loads) joins
    # adjacent special tokens without spaces for the Llama family, as vLLM's fast path does.
    spaces_between_special_tokens: bool | None = None
    # logprobs name each token "token_id:N" instead of its text (for tokens that are not valid UTF-8 alone)
    return_tokens_as_token_ids: bool | None = None
    # The prompt's last k tokens only (-1: as many as leave room for max_tokens), before the context check.
    truncate_prompt_tokens: Count | None = _documented(minimum=-1)
    # Every sampled token is one of these (a constant mask row, ANDed with any grammar's).
    allowed_token_ids: list[int] | None = _documented(minItems=1, maxItems=MAX_ALLOWED_TOKEN_IDS,
                                                      items={"type": "integer", "minimum": 0})
    # vLLM's: each prompt token's logprob and rank, with the top k alternatives (not with stream).
    prompt_logprobs: Count | None = _documented(minimum=0, maximum=MAX_LOGPROBS)
    # Words no output may end with (tokenized as vLLM does); masked like a grammar's tokens.
    bad_words: list[str] | None = _documented(maxItems=MAX_BAD_WORDS // 2)
    # vLLM fields conveyor does not implement, declared so that asking for one is a 400 that names
    # it (unsupported_fields.UNSUPPORTED_FIELDS) rather than output that silently ignores it.
    use_beam_search: bool | None = None
    logits_processors: Any = None


class CompletionRequest(SamplingFields):
    # Required in the schema; a missing one still gets validation.py's own message.
    model_config = ConfigDict(json_schema_extra={"required": ["prompt"]})
    # Any: the allowed shapes (text, token ids, a batch of either) get one precise message in
    # validation.py; the schema still names them, so clients and fuzzers see the real shapes.
    prompt: Any = Field(default=None, json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "string"}, "maxItems": MAX_BATCH_SEQUENCES},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}, "maxItems": MAX_BATCH_SEQUENCES}]})
    # 0 only with echo: the prompt scored (its logprobs), nothing generated.
    max_tokens: Count | None = _documented(minimum=0)
    echo: bool | None = False
    suffix: str | None = None
    logprobs: Count | None = _documented(minimum=0, maximum=MAX_LOGPROBS)


class ChatMessage(BaseModel):
    """Extra keys (name, tool_calls, ...) are kept: chat templates may read them. Content parts
    stay dicts here; validation.py accepts text parts only, with a message naming the part."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # OpenAI's roles
    content: str | list[dict[str, Any]] | None = None


class ChatRendering(_Strict):
    """How the conversation becomes the prompt (HF apply_chat_template's switches, as vLLM takes them)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the prompt ends inside the last message: the model continues it
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template, e.g. enable_thinking


class ChatCompletionRequest(SamplingFields, ChatRendering):
    model_config = ConfigDict(json_schema_extra={"required": ["messages"]})
    messages: list[ChatMessage] = Field(default_factory=list, json_schema_extra={"minItems": 1})
    max_completion_tokens: Count | None = _documented(minimum=1)
    logprobs: bool | None = False
    top_logprobs: Count | None = _documented(minimum=0, maximum=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None  # checked by frontend/tools.py
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    # Chat fields of OpenAI (the legacy functions) and vLLM that conveyor does not implement, declared
    # so that asking for one is a 400 naming it (unsupported_fields.UNSUPPORTED_CHAT_FIELDS).
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    echo: Any = None


class TokenizeRequest(ChatRendering):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # with messages: rendered as the chat endpoint renders them
    add_special_tokens: bool = True
    return_token_strs: bool = False  # vLLM: each token's vocabulary string too (token_strs)


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
