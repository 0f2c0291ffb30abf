"""Tools in the prompt: through a template that renders them (as HF does), else the Hermes fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frontend.errors import APIError
from frontend.tokenizer import Tokenizer
from frontend.tool_prompt import render_with_tools, template_renders_tools
from frontend.tools import parse_tools
from tiny_model import build_tiny_tokenizer

TOOL_TEMPLATE = """{% if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}
{% if message.tool_calls %}{% for call in message.tool_calls %}CALL {{ call.function.name }} {{ call.function.arguments | tojson }}
{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1"},
]


def _tokenizer(out: Path, template: str) -> Tokenizer:
    build_tiny_tokenizer(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return Tokenizer.from_dir(out)


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tool-template")
    _tokenizer(out, TOOL_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("plain")
    build_tiny_tokenizer(out)  # its template ignores tools
    return Tokenizer.from_dir(out)


def test_a_template_that_renders_tools_gets_them_as_transformers_passes_them(tool_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = Tokenizer.from_dir(tool_dir)
    ours = render_with_tools(tokenizer, HISTORY, parse_tools([WEATHER], None), True)
    hf_history = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, HISTORY[2]]
    theirs = transformers.AutoTokenizer.from_pretrained(str(tool_dir)).apply_chat_template(
        hf_history, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert 'CALL get_weather {"city": "Paris"}' in ours


def test_a_template_that_ignores_tools_gets_the_hermes_system_message(plain: Tokenizer) -> None:
    text = render_with_tools(plain, HISTORY, parse_tools([WEATHER], None), True)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in system
    assert "<tool_call>" in system  # the format it asks for
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rest
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>' in rest
    assert rest.endswith("<|im_start|>assistant\n")


def test_the_tools_join_a_system_message_the_client_sent(plain: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = render_with_tools(plain, messages, parse_tools([WEATHER], None), True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and text.count("<|im_start|>system") == 1


def test_detects_whether_a_template_renders_tools(plain: Tokenizer) -> None:
    assert template_renders_tools(TOOL_TEMPLATE, ())
    assert not template_renders_tools(plain.chat_template, ())
    smollm = Path.home() / ".cache/conveyor/models/SmolLM2-135M-Instruct"
    if (smollm / "tokenizer.json").is_file():
        default = Tokenizer.from_dir(smollm)
        assert not template_renders_tools(default.chat_template, tuple(sorted(default.special_tokens.items())))


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "content": "21"}, "messages.0.tool_call_id"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]},
     "messages.0.tool_calls.0.function.name"),
    ({"role": "user", "content": "", "tool_calls": []}, "messages.0.tool_calls"),
])
def test_malformed_tool_history_is_a_400_naming_the_message(plain: Tokenizer, message: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        render_with_tools(plain, [message], [], True)
    assert info.value.param == param


def test_chat_requests_accept_tool_calls_and_tool_results_in_the_history(plain: Tokenizer) -> None:
    from frontend.protocol import ChatMessage
    from frontend.protocol import ChatRendering
    from frontend.prompt_text import chat_prompt_ids

    messages = [ChatMessage.model_validate(m) for m in
                [*HISTORY[:1], {**HISTORY[1], "content": None}, HISTORY[2]]]
    text = plain.decode(chat_prompt_ids(messages, plain, ChatRendering(), 512), skip_special_tokens=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>" in text
    with pytest.raises(APIError) as info:
        chat_prompt_ids([ChatMessage.model_validate({"role": "tool", "content": "x"})], plain, ChatRendering(), 512)
    assert info.value.param == "messages.0.tool_call_id"
