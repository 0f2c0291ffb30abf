"""The official OpenAI client against the app under a real uvicorn (fake engine behind it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from frontend.app import create_app
from frontend.server import bind_listen_socket

openai = pytest.importorskip("openai")


@pytest.fixture
def live_url(config, engine, tokenizer) -> Iterator[str]:
    listen_socket = bind_listen_socket("127.0.0.1", 0)
    app = create_app(config.with_updates(api_key="sesame"), engine, tokenizer)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listen_socket]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{listen_socket.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def openai_client(live_url):
    return openai.OpenAI(base_url=f"{live_url}/v1", api_key="sesame", max_retries=0)


def test_openai_client_completes_and_chats(openai_client, engine, reply_text):
    completion = openai_client.completions.create(model="tiny", prompt="The capital", max_tokens=40)
    assert completion.choices[0].text == reply_text
    assert completion.usage.completion_tokens == len(engine.reply_token_ids)
    chat = openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == reply_text
    assert chat.choices[0].finish_reason == "stop"


def test_openai_client_streams_chat_with_usage(openai_client, reply_text):
    stream = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply_text
    assert chunks[-1].usage.completion_tokens > 0


def test_openai_client_parses_n_choices_logprobs_and_cached_tokens(openai_client, engine, reply_text):
    engine.num_cached_tokens = 2
    completion = openai_client.completions.create(model="tiny", prompt="The capital", max_tokens=40,
                                                  n=2, logprobs=2, echo=True)
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.choices[1].text == "The capital" + reply_text
    assert completion.choices[1].logprobs.token_logprobs[0] is None
    assert "".join(completion.choices[1].logprobs.tokens) == completion.choices[1].text
    assert completion.usage.prompt_tokens_details.cached_tokens == 2
    chat = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(item.token for item in content) == reply_text
    assert bytes(content[0].bytes).decode() == content[0].token
    assert len(content[0].top_logprobs) == 2


def test_openai_client_sees_typed_errors(openai_client, live_url):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        openai_client.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="tiny"):
        openai_client.completions.create(model="gpt-9", prompt="x")
    stranger = openai.OpenAI(base_url=f"{live_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def test_closing_a_real_connection_mid_stream_aborts_the_request(live_url, engine):
    engine.hang = True
    headers = {"Authorization": "Bearer sesame"}
    with httpx.stream("POST", f"{live_url}/v1/completions", headers=headers,
                      json={"prompt": "x", "max_tokens": 50, "stream": True}) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 5
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.aborted == [engine.added[0].request_id]
