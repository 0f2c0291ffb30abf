"""Tools and tool-call history into the prompt: through the chat template, or a Hermes fallback.

A template that renders `tools` gets them as HF's apply_chat_template passes them (`tools=`,
the client's tool objects) and the history as HF templates expect it (assistant `tool_calls`
with `arguments` parsed to an object, `tool` messages as they are). A template that ignores
`tools` (SmolLM2's does) would silently drop them, so conveyor then writes them itself, in the
Hermes format that Qwen2.5's template uses: a system message listing the tools in `<tools>`
and asking for `<tool_call>{"name", "arguments"}</tool_call>`; past calls become that text in
the assistant's content and tool results become `<tool_response>` user turns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from frontend.chat_template import ChatTemplateError, render_chat_template
from frontend.errors import bad_request
from frontend.tokenizer import Tokenizer
from frontend.tools import Tool

_PROBE_NAME = "conveyor_probe_tool_7f3a"
HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def render_with_tools(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[Tool],
                      add_generation_prompt: bool, extra: Mapping[str, Any] | None = None) -> str:
    """The prompt text of a conversation that may offer tools and hold past calls and results
    (`extra`: more variables for the template)."""
    history = [_checked_history_message(m, i) for i, m in enumerate(messages)]
    if tokenizer.chat_template is None or template_renders_tools(tokenizer.chat_template,
                                                                 tuple(sorted(tokenizer.special_tokens.items()))):
        raw_tools = [tool.raw for tool in tools] or None
        return tokenizer.render_chat(history, add_generation_prompt, raw_tools, extra)
    return tokenizer.render_chat(hermes_messages(history, tools), add_generation_prompt, extra=extra)


@lru_cache(maxsize=8)
def template_renders_tools(template: str, special_tokens: tuple[tuple[str, str], ...]) -> bool:
    """Whether the template writes what it is given as `tools` (tried once per template)."""
    probe = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = render_chat_template(template, messages, True, dict(special_tokens), tools=probe)
    except ChatTemplateError:
        return False
    return _PROBE_NAME in text


def hermes_messages(history: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """The conversation for a template that ignores tools: tools in the system message, calls and
    results written out as Hermes text."""
    converted = [_hermes_message(m) for m in history]
    if not tools:
        return converted
    listing = "\n".join(json.dumps(tool.raw, ensure_ascii=False) for tool in tools)
    tools_text = HERMES_TOOLS_PROMPT.format(tools=listing)
    if converted and converted[0]["role"] in ("system", "developer"):
        first = converted[0]
        return [{**first, "role": "system", "content": f"{first['content']}\n\n{tools_text}"}, *converted[1:]]
    return [{"role": "system", "content": tools_text}, *converted]


def _hermes_message(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return message
    blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                         ensure_ascii=False) for c in calls]
    text = "\n".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)
    content = f"{message['content']}\n{text}" if message["content"] else text
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": content}


def _checked_history_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """`tool` messages need a tool_call_id; assistant tool_calls need ids, names and JSON arguments,
    which are parsed into objects (HF templates index into them, as vLLM passes them)."""
    param = f"messages.{index}"
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise bad_request(f"{param}.tool_call_id is required on a tool message: the id of the call "
                          "it answers", f"{param}.tool_call_id")
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if message["role"] != "assistant" or not isinstance(calls, list):
        raise bad_request(f"{param}.tool_calls must be a list, on an assistant message", f"{param}.tool_calls")
    return {**message, "tool_calls": [_checked_call(c, f"{param}.tool_calls.{i}") for i, c in enumerate(calls)]}


def _checked_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{param}.function.name is required", f"{param}.function.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise bad_request(f"{param}.function.arguments is not valid JSON: {exc}",
                              f"{param}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"{param}.function.arguments must be a JSON object", f"{param}.function.arguments")
    return {"id": call.get("id", ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}
