"""The default model (SmolLM2-135M-Instruct) with structured output and tool calling, through the
official OpenAI client: one test of each kind."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import pytest
from pydantic import BaseModel
from support import free_port

from deploy.launcher import Stack
from deploy.model_info import read_model_info
from deploy.model_source import default_model_dir
from proto.config import EngineConfig

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


class Capital(BaseModel):
    country: str
    capital: str
    continent: Literal["Africa", "Asia", "Europe", "North America", "Oceania", "South America"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client() -> Iterator:
    model_dir = default_model_dir()
    info = read_model_info(model_dir)
    config = EngineConfig(model=str(model_dir), served_model_name="smollm2", vocab_size=info.vocab_size,
                          eos_token_ids=info.eos_token_ids, max_model_len=2048, port=free_port(),
                          kv_cache_memory_bytes=256 << 20, log_level="warning")
    with Stack(config) as stack:
        yield openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _parse(client, **kwargs):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    return parse(**kwargs)


def test_parse_with_a_pydantic_model_names_paris(client) -> None:
    completion = _parse(client, model="smollm2", temperature=0, max_tokens=64, response_format=Capital,
                        messages=[{"role": "user", "content": "Give the capital of France as JSON."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Capital) and "Paris" in parsed.capital and parsed.continent == "Europe"


def test_json_object_output_parses(client) -> None:
    completion = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=96, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Answer with a JSON object with one key, "city": the capital of France.'}])
    assert completion.choices[0].finish_reason == "stop", completion.choices[0].message.content
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


@pytest.mark.parametrize("structured_outputs, check", [
    ({"regex": "[0-9]{4}"}, lambda text: re.fullmatch("[0-9]{4}", text)),
    ({"choice": ["Paris", "London", "Berlin"]}, lambda text: text in ("Paris", "London", "Berlin")),
], ids=["regex", "choice"])
def test_regex_and_choice_outputs_match(client, structured_outputs, check) -> None:
    completion = client.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=16, extra_body={"structured_outputs": structured_outputs},
        messages=[{"role": "user", "content": "The capital of France, or the year it was founded?"}])
    assert completion.choices[0].finish_reason == "stop"
    assert check(completion.choices[0].message.content), completion.choices[0].message.content


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}},
                                         "required"], ids=["named", "required"])
def test_forced_tool_calls_ask_for_the_weather_in_paris(client, tool_choice) -> None:
    completion = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=64,
                                                messages=ASK, tools=[WEATHER], tool_choice=tool_choice)
    choice = completion.choices[0]
    assert choice.finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")  # named: OpenAI's
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "unit"}
    assert "Paris" in arguments["city"] and arguments["unit"] in ("celsius", "fahrenheit")


def test_streamed_tool_call_reassembles_to_the_non_streamed_one(client) -> None:
    kwargs = dict(model="smollm2", temperature=0, max_tokens=64, messages=ASK, tools=[WEATHER],
                  tool_choice="required")
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for part in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            call = calls.setdefault(part.index, {"name": "", "arguments": ""})
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole]
