"""Tool-call output parsers (Hermes, Llama 3 JSON) and the streaming deltas that reassemble to them."""

from __future__ import annotations

import json

import pytest

from frontend.tool_parsers import HermesParser, Llama3JsonParser, choose_tool_parser
from frontend.tool_stream import collect

HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_hermes_blocks_become_calls_and_the_text_before_is_content() -> None:
    parsed = HermesParser().parse(HERMES_TWO)
    assert parsed.content == "Let me check."
    assert _calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    assert len({c["id"] for c in parsed.tool_calls}) == 2


def test_hermes_only_calls_has_null_content_and_an_unclosed_last_block_still_counts() -> None:
    parsed = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert parsed.content is None and _calls(parsed) == [("f", {"x": 1})]


@pytest.mark.parametrize("text", ["plain answer", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>', "a < b <tool"])
def test_text_that_is_not_a_call_stays_content(text: str) -> None:
    parsed = HermesParser().parse(f"\n {text}\n")
    assert parsed.content == text and parsed.tool_calls == []  # stripped, as with calls


def test_string_arguments_are_read_as_their_json_object() -> None:
    parsed = HermesParser().parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert _calls(parsed) == [("f", {"a": 2})]


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
    '  {"name": "get_weather", "arguments": {"city": "Rome"}}',
])
def test_llama3_json_call(text: str) -> None:
    parsed = Llama3JsonParser().parse(text)
    assert parsed.content is None and _calls(parsed) == [("get_weather", {"city": "Rome"})]


def test_llama3_json_several_calls_and_plain_text() -> None:
    parsed = Llama3JsonParser().parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 1}}')
    assert _calls(parsed) == [("a", {}), ("b", {"k": 1})]
    assert Llama3JsonParser().parse("The weather is fine.").content == "The weather is fine."
    assert Llama3JsonParser().parse('{"name": "a", "parameters": {}} trailing').tool_calls == []


def _streamed(parser, text: str, piece: int) -> tuple[str, list[dict], list[dict]]:
    stream, deltas = parser.stream(), []
    for start in range(0, len(text), piece):
        deltas += stream.feed(text[start:start + piece])
    deltas += stream.finish()
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", ()):
            if "id" in part:
                assert part["type"] == "function" and part["function"]["arguments"] == ""
                calls.append({"name": part["function"]["name"], "arguments": ""})
            calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return content, calls, deltas


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
@pytest.mark.parametrize("parser, text", [
    (HermesParser(), HERMES_TWO),
    (HermesParser(), "no calls here, only <b>text</b> and a <tool"),
    (HermesParser(), '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
                     '"arguments": {}}</tool_call>\n'),
    (HermesParser(), ' Let me check. <tool_call>{"name": "a", "arguments": {}}</tool_call>  Done. \n'),
    (HermesParser(), '\n\nAnswer:\n\n  indented\n'),
    (Llama3JsonParser(), '<|python_tag|>{"name": "a", "parameters": {"q": "x y"}}'),
    (Llama3JsonParser(), "Just words."),
])
def test_streamed_deltas_reassemble_to_the_non_streaming_result(parser, text: str, piece: int) -> None:
    content, calls, deltas = _streamed(parser, text, piece)
    whole = parser.parse(text)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == _calls(whole)
    assert (content or None) == whole.content  # the very same text, whitespace included


def test_no_marker_prefix_is_ever_sent_as_content() -> None:
    _, _, deltas = _streamed(HermesParser(), HERMES_TWO, 1)
    assert not any("<" in d.get("content", "") for d in deltas)


def test_collect_gives_content_and_calls() -> None:
    content, calls = collect(HermesParser().stream(), HERMES_TWO)
    assert content.startswith("Let me check.") and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


def test_parser_chosen_by_flag_or_template() -> None:
    assert choose_tool_parser("llama3_json", "qwen2", None).name == "llama3_json"
    assert choose_tool_parser(None, "llama", "{{ '<|eot_id|>' }}").name == "llama3_json"
    assert choose_tool_parser(None, "llama", "<|im_start|>").name == "hermes"
    assert choose_tool_parser("qwen", "qwen2", None).name == "hermes"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        choose_tool_parser("mistral", "llama", None)
