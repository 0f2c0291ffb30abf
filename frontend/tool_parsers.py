"""Tool calls read out of an `auto` output, in the format of the model's family.

- hermes (Hermes 2 Pro, Qwen2/2.5/3, and conveyor's own fallback prompt): `<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>` blocks among the text;
- llama3_json (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}` objects,
  optionally after `<|python_tag|>`, separated by `;`.

A block that does not parse as a call stays in the content: the client sees what the model
wrote. `arguments` is always the JSON text of an object, as OpenAI sends it. Streaming and
non-streaming read the output with the same stream (frontend/tool_stream.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from frontend.tool_stream import Delta, HermesStream, JsonCallsStream, ToolCallStream, collect
from frontend.tools import ToolChoice, forced_tool_calls, tool_call


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # stripped; None when the output held only calls (OpenAI sends null then)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def call_from_json(text: str, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
                   ) -> dict[str, Any] | None:
    """One OpenAI tool call from `{"name": ..., "arguments" | "parameters": {...}}`, else None."""
    try:
        document = json.loads(text)
    except ValueError:
        return None
    if not isinstance(document, dict) or not isinstance(document.get("name"), str):
        return None
    arguments = next((document[key] for key in arguments_keys if key in document), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return tool_call(document["name"], arguments)


class ToolParser:
    name = ""

    def stream(self) -> HermesStream | JsonCallsStream:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        content, calls = collect(self.stream(), text)
        return ParsedOutput(content or None, calls)  # stripped by the stream


class HermesParser(ToolParser):
    name = "hermes"

    def stream(self) -> HermesStream:
        return HermesStream(call_from_json)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> JsonCallsStream:
        return JsonCallsStream(lambda text: call_from_json(text, ("parameters", "arguments")))


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen": HermesParser, "llama3_json": Llama3JsonParser}


def choose_tool_parser(flag: str | None, model_type: str, chat_template: str | None) -> ToolParser:
    """`--tool-call-parser` when given; else Llama 3 JSON for a Llama 3 chat template (it writes
    `<|eot_id|>`), Hermes for everything else (Qwen, Hermes, and the fallback prompt)."""
    if flag:
        if flag not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {flag!r}: choose one of {', '.join(TOOL_PARSERS)}")
        return TOOL_PARSERS[flag]()
    if model_type == "llama" and chat_template and "<|eot_id|>" in chat_template:
        return Llama3JsonParser()
    return HermesParser()


class ForcedCallsStream(ToolCallStream):
    """The output of a forced tool choice (required, named), shaped by its grammar: nothing is sent
    while it grows; its calls are sent when it ends, or its text as content when it was cut short
    before it was a whole document (finish_reason `length`)."""

    def __init__(self, choice: ToolChoice) -> None:
        super().__init__()
        self._choice, self._buffer = choice, ""

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        return []

    def _finish_output(self) -> list[Delta]:
        text, self._buffer = self._buffer, ""
        calls = forced_tool_calls(self._choice, text)
        if not calls:
            return self._content(text)
        return [delta for call in calls for delta in self._call_deltas(call)]


def output_stream(choice: ToolChoice, parser: ToolParser) -> ToolCallStream | None:
    """The reader of one chat choice's output: None when it is plain content (tool_choice none).
    Without parallel calls it keeps the output's first call and drops the others, as OpenAI and
    vLLM do: in `auto` nothing in the output stops a model from writing several."""
    if choice.mode == "none":
        return None
    stream = ForcedCallsStream(choice) if choice.mode in ("required", "named") else parser.stream()
    if not choice.parallel:
        stream.max_calls = 1
    return stream


def read_output(choice: ToolChoice, parser: ToolParser, text: str) -> ParsedOutput:
    """A whole chat output: its content and tool calls, exactly as its stream would send them."""
    stream = output_stream(choice, parser)
    if stream is None:
        return ParsedOutput(text)
    content, calls = collect(stream, text)
    return ParsedOutput(content or None, calls)  # stripped by the stream
