"""Prompts as text: a chat conversation rendered to the prompt's token ids (tools, continuing the
final message, the template's extra variables), and the bound a prompt text is held to before it
is tokenized."""

from __future__ import annotations

from typing import Any, Sequence

from frontend.chat_template import RESERVED_TEMPLATE_VARIABLES
from frontend.errors import bad_request
from frontend.protocol import ChatMessage, ChatRendering
from frontend.tokenizer import Tokenizer
from frontend.tool_prompt import render_with_tools
from frontend.tools import Tool
from proto.config import prompt_fits


def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Tokenizer, rendering: ChatRendering,
                    max_model_len: int | None, tools: Sequence[Tool] = ()) -> list[int]:
    """The rendered conversation's token ids; 400 at once when its text alone is certainly longer
    than `max_model_len` tokens (see `check_text_fits`; None: the prompt is truncated after, so
    only the request body's size bounds it). Tool calls and tool results in the
    history, and `tools`, are rendered as frontend/tool_prompt.py says; `rendering` says whether
    the prompt opens the assistant's turn or continues the final message, and passes the
    template's extra variables."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    template_kwargs = _template_kwargs(rendering)
    template_messages = [_template_message(m, i) for i, m in enumerate(messages)]
    try:
        text = render_with_tools(tokenizer, template_messages, list(tools), rendering.add_generation_prompt,
                                 template_kwargs)
    except ValueError as exc:  # ChatTemplateError, or the model has no chat template
        raise bad_request(str(exc), "messages") from exc
    if rendering.continue_final_message:
        text = _ending_in_final_message(text, template_messages[-1]["content"])
    if max_model_len is not None:
        check_text_fits(text, tokenizer, max_model_len, "messages")
    # The template already writes bos and friends, so encoding must not add them again.
    return tokenizer.encode(text, add_special_tokens=False)


def _template_kwargs(rendering: ChatRendering) -> dict[str, Any]:
    if rendering.continue_final_message and rendering.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: set "
                          "add_generation_prompt to false to continue the final message",
                          "continue_final_message")
    kwargs = dict(rendering.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(kwargs))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own "
                          "fields set them", "chat_template_kwargs")
    return kwargs


def _ending_in_final_message(text: str, final_content: str) -> str:
    """The rendered conversation cut right after the final message's content (whatever the template
    writes to close the turn is dropped), so that the model continues that message."""
    final = final_content.strip()
    at = text.rfind(final) if final else -1
    if at < 0:
        raise bad_request("continue_final_message needs the final message's content, which the chat "
                          "template does not write as it is", "continue_final_message")
    return text[:at + len(final)]


def check_text_fits(text: str, tokenizer: Tokenizer, max_model_len: int, param: str) -> None:
    """400 without tokenizing when `text` has at least max_model_len tokens by its length alone:
    tokenizing megabytes costs seconds of CPU for a request that must fail anyway."""
    at_least = tokenizer.min_num_tokens(text)
    if not prompt_fits(at_least, max_model_len):
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, but the "
                          f"prompt has at least {at_least} tokens ({len(text)} characters, no token "
                          f"longer than {tokenizer.max_token_bytes} bytes)", param,
                          "context_length_exceeded")


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """Text parts joined by newlines, as templates written for string content expect."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if part.get("type") != "text":
                raise bad_request(
                    f"messages[{index}].content[{part_index}]: only text parts "
                    f"({{\"type\": \"text\", \"text\": ...}}) are supported, got type {part.get('type')!r}",
                    f"messages.{index}.content")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content[{part_index}]: a text part needs \"text\", a "
                                  f"string, got {part.get('text')!r}", f"messages.{index}.content")
            texts.append(part["text"])
        content = "\n".join(texts)
    return {**(message.model_extra or {}), "role": message.role, "content": content or ""}
