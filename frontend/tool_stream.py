"""Streaming tool calls: output text in, OpenAI chat deltas out (`content` or `tool_calls`).

The one reading of a tool-call format: the non-streaming parsers (frontend/tool_parsers.py)
feed the whole output through the same stream, so a streamed call reassembles to exactly what
the non-streaming response holds. A call is sent when its block is complete, as two deltas in
OpenAI's shape: `{index, id, type, function: {name, arguments: ""}}`, then `{index, function:
{arguments}}`. Text that could still become a marker is held back, never sent as content first.
"""

from __future__ import annotations

import json
from typing import Any, Callable

Delta = dict[str, Any]  # one chat `delta`: {"content": ...} or {"tool_calls": [...]}
CallReader = Callable[[str], "dict[str, Any] | None"]


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may be a marker in the making)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """Shared bookkeeping: content deltas, and numbered call deltas. Content is the output's text
    without the whitespace that begins or ends it (what a non-streaming response holds): a run of
    whitespace is held until more content follows it, and dropped if none does, so an output of
    calls alone (and the newlines between them) has no content, OpenAI's null."""

    def __init__(self) -> None:
        self.num_calls = 0
        self.max_calls: int | None = None  # calls past it are dropped (parallel_tool_calls: false)
        self._content_started = False
        self._blank = ""  # whitespace held back

    def feed(self, text: str) -> list[Delta]:
        """The deltas `text` (the output's next piece) makes sendable."""
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        """The deltas of what is left when the output ends."""
        deltas = self._finish_output()
        self._blank = ""  # whitespace at the end
        return deltas

    def _finish_output(self) -> list[Delta]:
        raise NotImplementedError

    def _call_deltas(self, call: dict[str, Any]) -> list[Delta]:
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return []
        index, function = self.num_calls, call["function"]
        self.num_calls += 1
        head = {"index": index, "id": call["id"], "type": "function",
                "function": {"name": function["name"], "arguments": ""}}
        return [{"tool_calls": [head]},
                {"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]}]

    def _content(self, text: str) -> list[Delta]:
        text = self._blank + text
        if not self._content_started:
            text = text.lstrip()
        body = text.rstrip()
        self._blank = text[len(body):]
        if not body:
            return []
        self._content_started = True
        return [{"content": body}]


class HermesStream(ToolCallStream):
    """`<tool_call>{json}</tool_call>` blocks among free text; an unfinished block at the end is
    still a call when its JSON is whole (a model may stop before the closing tag)."""

    def __init__(self, read_call: CallReader, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        super().__init__()
        self._read_call, self._start, self._end = read_call, start, end
        self._buffer, self._in_block = "", False

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        deltas: list[Delta] = []
        while True:
            marker = self._end if self._in_block else self._start
            at = self._buffer.find(marker)
            if at < 0:
                if not self._in_block:
                    keep = _held_back(self._buffer, self._start)
                    deltas += self._content(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                return deltas
            before, self._buffer = self._buffer[:at], self._buffer[at + len(marker):]
            deltas += self._block(before) if self._in_block else self._content(before)
            self._in_block = not self._in_block

    def _finish_output(self) -> list[Delta]:
        rest, self._buffer = self._buffer, ""
        if not self._in_block:
            return self._content(rest)
        self._in_block = False
        call = self._read_call(rest.strip())
        return self._call_deltas(call) if call else self._content(self._start + rest)

    def _block(self, body: str) -> list[Delta]:
        call = self._read_call(body.strip())
        return self._call_deltas(call) if call else self._content(self._start + body + self._end)


class JsonCallsStream(ToolCallStream):
    """An output that is nothing but JSON call objects (Llama 3), optionally after `prefix`:
    decided by its first non-blank characters; calls are read when the output ends."""

    def __init__(self, read_call: CallReader, prefix: str = "<|python_tag|>") -> None:
        super().__init__()
        self._read_call, self._prefix = read_call, prefix
        self._buffer, self._mode = "", "undecided"  # -> "content" | "calls"

    def feed(self, text: str) -> list[Delta]:
        if self._mode == "content":
            return self._content(text)
        self._buffer += text
        head = self._buffer.lstrip()
        if self._mode == "undecided" and head:
            if head.startswith(("{", self._prefix)):
                self._mode = "calls"
            elif not self._prefix.startswith(head):
                self._mode, text, self._buffer = "content", self._buffer, ""
                return self._content(text)
        return []

    def _finish_output(self) -> list[Delta]:
        text, self._buffer = self._buffer, ""
        if self._mode != "calls":
            return self._content(text)
        calls = self._read_calls(text.strip().removeprefix(self._prefix).lstrip())
        if calls is None:
            return self._content(text)
        return [delta for call in calls for delta in self._call_deltas(call)]

    def _read_calls(self, body: str) -> list[dict[str, Any]] | None:
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            try:
                document, position = decoder.raw_decode(body, position)
            except ValueError:
                return None
            call = self._read_call(json.dumps(document, ensure_ascii=False))
            if call is None:
                return None
            calls.append(call)
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return calls or None


def collect(stream: ToolCallStream, text: str) -> tuple[str, list[dict[str, Any]]]:
    """The whole output through `stream`: its content and its tool calls, reassembled from deltas."""
    content, calls = [], []
    for delta in [*stream.feed(text), *stream.finish()]:
        if "content" in delta:
            content.append(delta["content"])
        for part in delta.get("tool_calls", ()):
            if "id" in part:
                calls.append({"id": part["id"], "type": "function",
                              "function": {"name": part["function"]["name"], "arguments": ""}})
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    return "".join(content), calls
