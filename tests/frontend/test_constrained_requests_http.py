"""Structured output and tool calling over HTTP with a fake engine: what reaches AddRequest.grammar,
the 400s that stop a request before it is queued, and tool_calls (non-streamed and streamed)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from frontend.errors import APIError
from frontend.grammar_check import BackgroundGrammarChecker, GrammarChecker
from frontend.tool_parsers import TOOL_PARSERS
from proto.config import TOOL_CALL_PARSERS, EngineConfig
from proto.errors import ValidationError
from proto.grammar import GrammarSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def config(tiny_model_dir) -> EngineConfig:
    """Room for the tool listing the fallback prompt writes (a few hundred tiny-tokenizer tokens)."""
    return EngineConfig(model=str(tiny_model_dir), served_model_name="tiny", max_model_len=2048,
                        vocab_size=512)

USER = [{"role": "user", "content": "Weather in Paris?"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def _reply(engine, tokenizer, text: str) -> None:
    engine.reply_token_ids = tokenizer.encode(text, add_special_tokens=False)


async def _chat(client, **fields: Any) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json={"messages": USER, **fields})
    assert response.status_code == 200, response.text
    return response.json()


async def _streamed_choice(client, sse, **fields: Any) -> tuple[list[dict], list[str]]:
    """The deltas of choice 0 and the finish reasons of a streamed chat."""
    response = await client.post("/v1/chat/completions",
                                 json={"messages": USER, "stream": True, **fields})
    assert response.status_code == 200, response.text
    events, done = sse(response.text)
    assert done
    choices = [c for e in events for c in e["choices"]]
    return [c["delta"] for c in choices], [c["finish_reason"] for c in choices if c["finish_reason"]]


def _reassemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """OpenAI's client-side rule: tool_calls parts merge by index; arguments concatenate."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"id": None, "type": None,
                                                    "function": {"name": "", "arguments": ""}})
            call["id"] = part.get("id") or call["id"]
            call["type"] = part.get("type") or call["type"]
            call["function"]["name"] += part.get("function", {}).get("name") or ""
            call["function"]["arguments"] += part.get("function", {}).get("arguments") or ""
    return content, [calls[i] for i in sorted(calls)]


def _without_ids(calls: list[dict]) -> list[dict]:
    return [{key: value for key, value in call.items() if key != "id"} for call in calls]


async def test_json_schema_response_format_reaches_the_engine_as_the_requests_grammar(client, engine):
    response = await client.post("/v1/completions", json={"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}})
    assert response.status_code == 200, response.text
    assert engine.added[-1].grammar == GrammarSpec.json_schema(SCHEMA)


@pytest.mark.parametrize("fields, spec", [
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object", "")),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, GrammarSpec("regex", "[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, GrammarSpec.choice(["yes", "no"])),
    ({"guided_grammar": 'start: "a"+'}, GrammarSpec("grammar", 'start: "a"+')),
])
async def test_each_structured_output_field_reaches_the_engine_on_chat(client, engine, fields, spec):
    await _chat(client, **fields)
    assert engine.added[-1].grammar == spec


async def test_free_text_requests_carry_no_grammar(client, engine):
    await _chat(client, response_format={"type": "text"})
    await _chat(client, tools=[WEATHER], tool_choice="auto")
    await _chat(client, tools=[WEATHER], tool_choice="none")
    assert [added.grammar for added in engine.added] == [None, None, None]


@pytest.mark.parametrize("fields, param, words", [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "cannot be used"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "not": {"type": "string"}}}}},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "cannot be used"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "tool_choice", "leave out the other output constraint"),
    ({"tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
     "tool_choice", "forces a tool call"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice", "not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}]},
     "tools.0.function.parameters", "must be a JSON schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]},
     "tools.0.function.parameters", "Unimplemented keys"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
async def test_a_bad_constraint_or_tool_is_a_400_naming_the_field_before_anything_is_queued(
        client, engine, fields, param, words):
    response = await client.post("/v1/chat/completions", json={"messages": USER, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert engine.added == []


async def test_named_tool_choice_is_the_functions_arguments_returned_as_one_tool_call(
        client, engine, tokenizer):
    _reply(engine, tokenizer, '{"city": "Paris"}')
    body = await _chat(client, tools=[WEATHER, TIME], tool_choice=NAMED)
    assert engine.added[-1].grammar == GrammarSpec.json_schema(PARAMETERS)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"  # OpenAI's for a named function: the call was asked for
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


async def test_required_tool_choice_returns_every_call_of_the_forced_array(client, engine, tokenizer):
    _reply(engine, tokenizer, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                              '{"name": "get_time", "parameters": {}}]')
    body = await _chat(client, tools=[WEATHER, TIME], tool_choice="required")
    assert engine.added[-1].grammar.kind == "json_schema"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": "{}"}]


async def test_parallel_tool_calls_false_allows_one_call(client, engine, tokenizer):
    await _chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(engine.added[-1].grammar.source)["maxItems"] == 1


async def test_a_forced_call_cut_short_by_max_tokens_is_content_with_length(client, engine, tokenizer):
    _reply(engine, tokenizer, '{"city": "Paris"}')
    body = await _chat(client, tools=[WEATHER], tool_choice=NAMED, max_tokens=3)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == tokenizer.decode(engine.reply_token_ids[:3])


@pytest.mark.parametrize("tool_choice, text", [(NAMED, "7"), ("required", "7"), ("required", '[1, {"name": 2}]')])
async def test_a_forced_output_not_of_the_grammars_shape_is_content_not_a_500(
        client, engine, tokenizer, sse, tool_choice, text):
    _reply(engine, tokenizer, text)
    choice = (await _chat(client, tools=[WEATHER], tool_choice=tool_choice))["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    deltas, finish_reasons = await _streamed_choice(client, sse, tools=[WEATHER], tool_choice=tool_choice)
    assert _reassemble(deltas) == (text, []) and finish_reasons == ["stop"]


async def test_auto_tool_choice_reads_hermes_calls_out_of_the_text(client, engine, tokenizer):
    _reply(engine, tokenizer, 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": '
                              '{"city": "Paris"}}\n</tool_call>')
    body = await _chat(client, tools=[WEATHER])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]


@pytest.mark.parametrize("parallel, calls", [(None, ["Paris", "London"]), (False, ["Paris"])])
async def test_without_parallel_tool_calls_auto_keeps_the_first_call_streamed_or_not(
        client, engine, tokenizer, sse, parallel, calls):
    # Nothing in an auto output keeps a model from writing two calls; OpenAI and vLLM return one.
    _reply(engine, tokenizer, 'Both.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                              '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": '
                              '"London"}}</tool_call>')
    fields = {"tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": parallel}
    choice = (await _chat(client, **fields))["choices"][0]
    assert [json.loads(c["function"]["arguments"])["city"] for c in choice["message"]["tool_calls"]] == calls
    assert (choice["message"]["content"], choice["finish_reason"]) == ("Both.", "tool_calls")
    deltas, finish_reasons = await _streamed_choice(client, sse, **fields)
    content, streamed = _reassemble(deltas)
    assert [json.loads(c["function"]["arguments"])["city"] for c in streamed] == calls
    assert (content, finish_reasons) == ("Both.", ["tool_calls"])


async def test_auto_without_a_call_and_tool_choice_none_are_plain_content(client, engine, tokenizer):
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    _reply(engine, tokenizer, text)
    body = await _chat(client, tools=[WEATHER], tool_choice="none")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == "stop"
    _reply(engine, tokenizer, "It is sunny.")
    body = await _chat(client, tools=[WEATHER])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}


@pytest.mark.parametrize("tool_choice, text", [
    ("auto", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (NAMED, '{"city": "Paris"}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
])
async def test_streamed_tool_calls_reassemble_to_the_non_streamed_response(
        client, engine, tokenizer, sse, tool_choice, text):
    _reply(engine, tokenizer, text)
    whole = (await _chat(client, tools=[WEATHER], tool_choice=tool_choice))["choices"][0]
    deltas, finish_reasons = await _streamed_choice(client, sse, tools=[WEATHER], tool_choice=tool_choice)
    content, calls = _reassemble(deltas)
    assert finish_reasons == [whole["finish_reason"]] == ["stop" if tool_choice == NAMED else "tool_calls"]
    assert _without_ids(calls) == _without_ids(whole["message"]["tool_calls"])
    assert content.strip() == (whole["message"]["content"] or "")
    heads = [part for d in deltas for part in d.get("tool_calls", ()) if "id" in part]
    assert all(h["type"] == "function" and h["id"].startswith("call_") and h["index"] == 0 for h in heads)
    assert not any("<tool_call>" in (d.get("content") or "") for d in deltas)


async def test_each_streamed_choice_has_its_own_tool_call_reader(client, engine, tokenizer, sse):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    engine.choice_replies = [tokenizer.encode(call, add_special_tokens=False),
                             tokenizer.encode("No call.", add_special_tokens=False)]
    response = await client.post("/v1/chat/completions", json={
        "messages": USER, "stream": True, "n": 2, "tools": [WEATHER]})
    events, _ = sse(response.text)
    choices = [c for e in events for c in e["choices"]]
    finish = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"]}
    assert finish == {0: "tool_calls", 1: "stop"}
    _, calls = _reassemble([c["delta"] for c in choices if c["index"] == 0])
    assert calls[0]["function"]["arguments"] == '{"city": "Rome"}'
    assert _reassemble([c["delta"] for c in choices if c["index"] == 1])[0] == "No call."


async def test_tools_reach_the_prompt(client, engine, tokenizer):
    await _chat(client, tools=[WEATHER])
    prompt = tokenizer.decode(engine.added[-1].prompt_token_ids, skip_special_tokens=False)
    assert "get_weather" in prompt and "<tool_call>" in prompt


def test_the_checker_builds_in_the_background_and_the_first_check_waits_for_it(tokenizer):
    built = threading.Event()

    def slow_build() -> GrammarChecker:
        time.sleep(0.3)
        checker = GrammarChecker.for_tokenizer(tokenizer, 512, (tokenizer.eos_token_id,))
        built.set()
        return checker

    started_s = time.monotonic()
    checker = BackgroundGrammarChecker(slow_build)
    assert time.monotonic() - started_s < 0.1 and not built.is_set()
    checker.check(GrammarSpec("regex", "a+"), "structured_outputs.regex")
    assert built.is_set()


def test_a_checker_that_could_not_be_built_makes_constrained_requests_a_400():
    def failing_build() -> GrammarChecker:
        raise ValueError("no byte-level tokenizer")

    with pytest.raises(APIError) as info:
        BackgroundGrammarChecker(failing_build).check(GrammarSpec("regex", "a"), "guided_regex")
    assert info.value.status == 400 and info.value.param == "guided_regex"
    assert "no byte-level tokenizer" in info.value.message


def test_tool_call_parser_flag_names_the_frontends_parsers():
    assert set(TOOL_CALL_PARSERS) == {"auto", *TOOL_PARSERS}
    with pytest.raises(ValidationError, match="tool_call_parser"):
        EngineConfig(tool_call_parser="mistral")


async def test_tool_call_parser_flag_picks_the_parser(make_http, config, engine, tokenizer):
    _reply(engine, tokenizer, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    async with make_http(config.with_updates(tool_call_parser="llama3_json")) as client:
        body = await _chat(client, tools=[WEATHER])
    assert body["choices"][0]["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
