"""Chat template rendering with a sandboxed jinja2 environment that behaves like Hugging Face's."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template raised (e.g. via raise_exception) or could not be compiled."""


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` markers and renders their body as-is.

    HF uses them to locate assistant tokens for training masks; serving only needs the text,
    but templates that contain them must still parse.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters and sorts keys, which changes prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per template text; trim/lstrip blocks match how the templates were written."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


# What the renderer sets itself: a request's chat_template_kwargs may not.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


def render_chat_template(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                         special_tokens: dict[str, str], tools: list[dict[str, Any]] | None = None,
                         extra: Mapping[str, Any] | None = None) -> str:
    """Render `messages` to the prompt text; `special_tokens` holds bos_token, eos_token, ...;
    `extra`: more template variables (a request's chat_template_kwargs; none of
    RESERVED_TEMPLATE_VARIABLES).

    `tools` and `documents` are always passed (None when absent) because templates test
    `tools is not none`, exactly as they do under HF's apply_chat_template.
    """
    template = compile_chat_template(source)
    # One mapping, not keywords: any name (even render's own `self`) is just a template variable.
    variables = {"documents": None, **special_tokens, **(extra or {}), "messages": messages, "tools": tools,
                 "add_generation_prompt": add_generation_prompt}
    try:
        return template.render(variables)
    except Exception as exc:  # template code fails on odd messages in any way (TypeError, ...)
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
