"""`tools` and `tool_choice`: validation, the grammar that forces a call, and the calls read back.

`required` and a named function are enforced by a JSON schema grammar, as vLLM does: a named
choice makes the output the function's arguments object; `required` makes it a JSON array of
`{"name": ..., "parameters": ...}`, each item one of the tools. Either way the arguments always
validate against the function's `parameters`. `auto` leaves the output free; a tool-call
parser (frontend/tool_parsers.py) reads calls out of the text afterwards.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from frontend.errors import bad_request
from frontend.grammar_check import GrammarCheck
from proto.grammar import GrammarSpec

MAX_TOOLS = 128
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule (plus dots, as vLLM allows)
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema; {"type": "object", "properties": {}} when absent
    raw: dict[str, Any]  # the client's tool object, as chat templates take it (`tools=`)


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str = ""  # the function, when mode is "named"
    parallel: bool = True  # parallel_tool_calls: false -> one call at most, whatever the mode


def parse_tools(tools: list[dict[str, Any]] | None, checker: GrammarCheck | None) -> list[Tool]:
    """Each tool must be {"type": "function", "function": {"name", "description"?, "parameters"?}}
    and its parameters a schema the grammar engine compiles (checked when `checker` is given)."""
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", "tools")
    parsed, seen = [], set()
    for index, raw in enumerate(tools):
        tool = _parse_tool(raw, f"tools.{index}")
        if tool.name in seen:
            raise bad_request(f"tools.{index}.function.name {tool.name!r} is given twice",
                              f"tools.{index}.function.name")
        seen.add(tool.name)
        if checker is not None:
            checker.check(GrammarSpec.json_schema(tool.parameters), f"tools.{index}.function.parameters")
        parsed.append(tool)
    return parsed


def _parse_tool(raw: Any, param: str) -> Tool:
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise bad_request(f'{param}.type must be "function"', f"{param}.type")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{param}.function is required: an object with a name", f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise bad_request(f"{param}.function.name must be 1 to 64 letters, digits, _, . or -",
                          f"{param}.function.name")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise bad_request(f"{param}.function.description must be a string", f"{param}.function.description")
    parameters = function.get("parameters", _EMPTY_PARAMETERS)
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise bad_request(f"{param}.function.parameters must be a JSON schema object, got "
                          f"{type(parameters).__name__}", f"{param}.function.parameters")
    return Tool(name, description, parameters, raw)


def parse_tool_choice(tool_choice: str | dict[str, Any] | None, tools: list[Tool]) -> ToolChoice:
    """OpenAI's default: "auto" when there are tools, "none" when there are none."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                              f'"function": {{"name": ...}}}}, got {tool_choice[:40]!r}', "tool_choice")
        if tool_choice != "none" and not tools:
            raise bad_request(f'tool_choice "{tool_choice}" needs tools', "tool_choice")
        return ToolChoice(tool_choice)
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                          "tool_choice")
    if name not in {tool.name for tool in tools}:
        raise bad_request(f"tool_choice names function {name[:64]!r}, which is not in tools", "tool_choice")
    return ToolChoice("named", name)


def tool_choice_grammar(choice: ToolChoice, tools: list[Tool]) -> GrammarSpec | None:
    """The grammar that forces a call for `required` and named choices; None for none and auto."""
    if choice.mode == "named":
        return GrammarSpec.json_schema(next(t for t in tools if t.name == choice.name).parameters)
    if choice.mode != "required":
        return None
    calls = {"type": "array", "minItems": 1,
             "items": {"anyOf": [_named_call_schema(tool) for tool in tools]}}
    if not choice.parallel:
        calls["maxItems"] = 1
    return GrammarSpec.json_schema(calls)


def _named_call_schema(tool: Tool) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, "parameters": tool.parameters},
            "required": ["name", "parameters"], "additionalProperties": False}


def forced_tool_calls(choice: ToolChoice, output_text: str) -> list[dict[str, Any]]:
    """OpenAI tool_calls from the output of a forced choice (grammar-shaped, so it parses);
    [] for a cut-short output that is not yet a whole document (finish_reason `length`)."""
    try:
        document = json.loads(output_text)
    except ValueError:
        return []
    if choice.mode == "named":
        return [tool_call(choice.name, document)] if isinstance(document, dict) else []
    if not isinstance(document, list) or not all(_is_named_call(call) for call in document):
        return []  # not the grammar's shape (only an engine that did not apply it writes this)
    return [tool_call(call["name"], call["parameters"]) for call in document]


def _is_named_call(call: Any) -> bool:
    return (isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("parameters"), dict))


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """One OpenAI tool call; `arguments` is a JSON string in the API, whatever the model wrote."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or new_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": text}}


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
