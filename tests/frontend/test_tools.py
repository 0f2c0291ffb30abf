"""tools and tool_choice: validation, the grammar that forces a call, and the calls read back."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from frontend.errors import APIError
from frontend.grammar_check import GrammarChecker
from frontend.tokenizer import Tokenizer
from frontend.tools import (ToolChoice, forced_tool_calls, parse_tool_choice, parse_tools,
                            tool_choice_grammar)
from proto.grammar import engine_grammar
from tiny_model import build_tiny_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(out)
    return Tokenizer.from_dir(out)


@pytest.fixture(scope="module")
def checker(tokenizer: Tokenizer) -> GrammarChecker:
    return GrammarChecker.for_tokenizer(tokenizer, 512, (tokenizer.eos_token_id,))


def _refused(call: Any) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    assert info.value.status == 400
    return info.value


def _accepts(tokenizer: Tokenizer, spec: Any, text: str) -> bool:
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), eos_token=tokenizer.eos_token_id)
    matcher = llguidance.LLMatcher(ll_tokenizer, engine_grammar(spec), log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_tools_parse_with_default_parameters(checker: GrammarChecker) -> None:
    weather, clock = parse_tools([WEATHER, TIME], checker)
    assert (weather.name, weather.description, clock.name) == ("get_weather", "Weather in a city", "get_time")
    assert clock.parameters == {"type": "object", "properties": {}} and clock.raw is TIME


@pytest.mark.parametrize("tools, param, says", [
    ([{"type": "function"}], "tools.0.function", "is required"),
    ([{"type": "retrieval"}], "tools.0.type", '"function"'),
    ([{"type": "function", "function": {"name": "has space"}}], "tools.0.function.name", "letters"),
    ([WEATHER, WEATHER], "tools.1.function.name", "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}],
     "tools.0.function.parameters", "must be a JSON schema object, got str"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "dict"}}}],
     "tools.0.function.parameters", "Invalid type"),
])
def test_bad_tool_is_a_400_naming_the_field(checker: GrammarChecker, tools: list, param: str,
                                            says: str) -> None:
    error = _refused(lambda: parse_tools(tools, checker))
    assert error.param == param and says in error.message


def test_tool_choice_defaults_follow_openai() -> None:
    tools = parse_tools([WEATHER], None)
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("none", tools) == ToolChoice("none")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse_tool_choice(named, tools) == ToolChoice("named", "get_weather")


@pytest.mark.parametrize("choice, says", [
    ({"type": "function", "function": {"name": "get_time"}}, "not in tools"),
    ("sometimes", 'must be "none", "auto", "required"'),
    ({"type": "function"}, "named tool_choice is"),
])
def test_bad_tool_choice_is_a_400(choice: Any, says: str) -> None:
    error = _refused(lambda: parse_tool_choice(choice, parse_tools([WEATHER], None)))
    assert error.param == "tool_choice" and says in error.message


def test_required_needs_tools() -> None:
    assert "needs tools" in _refused(lambda: parse_tool_choice("required", [])).message


def test_named_choice_output_is_the_arguments_and_validates(tokenizer: Tokenizer, checker: GrammarChecker) -> None:
    tools = parse_tools([WEATHER, TIME], checker)
    choice = parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools)
    spec = tool_choice_grammar(choice, tools)
    checker.check(spec, "tool_choice")
    assert _accepts(tokenizer, spec, '{"city": "Paris", "unit": "c"}')
    assert not _accepts(tokenizer, spec, '{"city": "Paris", "unit": "k"}')
    [call] = forced_tool_calls(choice, '{"city": "Paris", "unit": "c"}')
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")


def test_required_choice_output_is_a_list_of_calls_to_known_tools(tokenizer: Tokenizer,
                                                                 checker: GrammarChecker) -> None:
    tools = parse_tools([WEATHER, TIME], checker)
    choice = parse_tool_choice("required", tools)
    spec = tool_choice_grammar(choice, tools)
    checker.check(spec, "tool_choice")
    text = ('[{"name": "get_time", "parameters": {}}, '
            '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}]')
    assert _accepts(tokenizer, spec, text)
    assert not _accepts(tokenizer, spec, "[]")
    assert not _accepts(tokenizer, spec, '[{"name": "get_date", "parameters": {}}]')
    calls = forced_tool_calls(choice, text)
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "f"}


def test_one_call_at_most_without_parallel_tool_calls(tokenizer: Tokenizer) -> None:
    tools = parse_tools([TIME], None)
    spec = tool_choice_grammar(ToolChoice("required", parallel=False), tools)
    one = '[{"name": "get_time", "parameters": {}}]'
    assert _accepts(tokenizer, spec, one)
    assert not _accepts(tokenizer, spec, one[:-1] + ', {"name": "get_time", "parameters": {}}]')


def test_auto_and_none_add_no_grammar_and_a_cut_output_gives_no_call() -> None:
    tools = parse_tools([WEATHER], None)
    assert tool_choice_grammar(ToolChoice("auto"), tools) is None
    assert tool_choice_grammar(ToolChoice("none"), tools) is None
    assert forced_tool_calls(ToolChoice("named", "get_weather"), '{"city": "Par') == []
