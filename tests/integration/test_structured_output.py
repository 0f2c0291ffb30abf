"""Structured output and tool calling through the real stack, with the official OpenAI client: a
random tiny model writes valid JSON, matching regexes and choices, and valid tool calls only
because the grammar masks its logits."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field
from support import tiny_config
from tiny_model import build_tiny_model

from deploy.launcher import Stack

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confident: bool
    word: str = Field(max_length=6)


class Digit(BaseModel):
    # No other properties: JSON Schema allows them by default, and a random model sampled at
    # temperature 1 would write property names until max_tokens.
    model_config = ConfigDict(extra="forbid")
    x: int = Field(ge=0, le=9)


DIGIT_TOOL = {"type": "function", "function": {"name": "set_digit", "description": "Set x",
                                               "parameters": Digit.model_json_schema()}}
FLAG_TOOL = {"type": "function", "function": {"name": "flag", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A tiny model with room for the tool listing its (tool-less) template gets written."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=2048)
    with Stack(tiny_config(Path(model_dir)), log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _parse(client, **kwargs):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    return parse(**kwargs)


def test_chat_completions_parse_with_a_pydantic_model_returns_the_parsed_object(client) -> None:
    for seed in range(3):
        completion = _parse(client, model="tiny", messages=MESSAGES, response_format=Verdict,
                            temperature=1.0, seed=seed, max_tokens=96)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Verdict)


def test_json_object_output_parses_as_an_object(client) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format={"type": "json_object"}, n=3,
        temperature=1.0, seed=1, max_tokens=200)
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_completions_json_schema_output_validates(stack: Stack) -> None:
    body = {"model": "tiny", "prompt": "Digit:", "max_tokens": 32, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "digit", "schema": Digit.model_json_schema()}}}
    response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    Digit.model_validate_json(choice["text"])


@pytest.mark.parametrize("structured_outputs, matches", [
    ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
    ({"choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"grammar": 'start: "a" ("b" | "c")+ "."'}, lambda text: re.fullmatch("a[bc]+\\.", text)),
], ids=["regex", "choice", "grammar"])
def test_structured_outputs_sent_through_extra_body_match(client, structured_outputs, matches) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, n=4, temperature=1.0, seed=3, max_tokens=32,
        extra_body={"structured_outputs": structured_outputs})
    for choice in completion.choices:
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert matches(choice.message.content), choice.message.content
    assert any(choice.finish_reason == "stop" for choice in completion.choices)


def test_named_tool_choice_returns_a_call_whose_arguments_validate(client) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[DIGIT_TOOL, FLAG_TOOL], temperature=0, max_tokens=32,
        tool_choice={"type": "function", "function": {"name": "set_digit"}})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's for a call of a named function
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "set_digit" and call.id
    Digit.model_validate_json(call.function.arguments)


def test_required_tool_choice_returns_calls_of_the_given_tools(client) -> None:
    completion = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[DIGIT_TOOL, FLAG_TOOL], tool_choice="required",
        temperature=1.0, seed=5, max_tokens=96)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        if call.function.name == "set_digit":
            Digit.model_validate(arguments)
        else:
            assert call.function.name == "flag" and isinstance(arguments["on"], bool)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "set_digit"}},
                                         "required"], ids=["named", "required"])
def test_streamed_tool_calls_reassemble_to_the_same_call(client, tool_choice) -> None:
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[DIGIT_TOOL, FLAG_TOOL], tool_choice=tool_choice,
                  temperature=0, max_tokens=96)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish_reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish_reasons += [choice.finish_reason] if choice.finish_reason else []
            for part in choice.delta.tool_calls or ():
                call = calls.setdefault(part.index, {"name": "", "arguments": ""})
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
    assert finish_reasons == [whole.finish_reason] == ["stop" if isinstance(tool_choice, dict) else "tool_calls"]
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]


async def _complete_together(base_url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for body in bodies))
    assert all(response.status_code == 200 for response in responses), [r.text for r in responses]
    return [response.json()["choices"][0] for response in responses]


def test_a_constrained_row_next_to_unconstrained_rows_gives_each_its_solo_output(stack: Stack) -> None:
    base = {"model": "tiny", "max_tokens": 24, "temperature": 0}
    bodies = [{**base, "prompt": "The quick brown fox", "ignore_eos": True},
              {**base, "prompt": "Digit:", "response_format": {"type": "json_schema", "json_schema": {
                  "name": "digit", "schema": Digit.model_json_schema()}}},
              {**base, "prompt": "Paged attention", "ignore_eos": True},
              {**base, "prompt": "Code:", "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}]
    solo = []
    for body in bodies:
        response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        solo.append(response.json()["choices"][0])
    together = asyncio.run(_complete_together(stack.url, bodies))
    for body, alone, batched in zip(bodies, solo, together):
        assert (batched["text"], batched["finish_reason"]) == (alone["text"], alone["finish_reason"]), body
    Digit.model_validate_json(together[1]["text"])
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", together[3]["text"])
