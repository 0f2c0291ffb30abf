"""Every bad request gets the right status and an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from frontend.protocol import DetokenizeRequest
from proto.messages import ERROR_INVALID_REQUEST, ERROR_QUEUE_FULL

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hi"}]

BAD_COMPLETIONS = [
    # (request body, param, words the message must contain)
    ({"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": "x", "temperature": -1}, "temperature", ">= 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens", ">= 1"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "integer"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens", "integer"),
    ({"prompt": "x", "n": True}, "n", "integer"),
    ({"prompt": "x", "n": 17}, "n", "between 1 and 16, got 17"),
    ({"prompt": "x", "n": 0}, "n", "between 1 and 16, got 0"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of", "must equal n (2)"),
    ({"prompt": "x", "stop": [str(i) for i in range(17)]}, "stop", "at most 16"),
    ({"prompt": "x", "stop": ""}, "stop", "empty"),
    ({"prompt": "x", "stop": 5}, "stop", "valid string"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias", "<= 100"),
    ({"prompt": "x", "stop_token_ids": [100000]}, "stop_token_ids", "out of range"),
    ({"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens", "<= 5"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "between 0 and 20, got 21"),
    ({"prompt": "x", "logprobs": -1}, "logprobs", "between 0 and 20, got -1"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),
    ({"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 3}, "min_tokens", "must be 0 when max_tokens is 0"),
    ({"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}, "stream_options",
     "only allowed with stream: true"),
    ({}, "prompt", "required"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ["a"] * 17, "n": 16}, "prompt", "at most 256 sequences (prompts x n), got 17 x 16"),
    ({"prompt": ["a", ""]}, "prompt", "prompt 1: prompt must not be empty"),
    ({"prompt": [[5, 6], [7, 99999]]}, "prompt", "prompt 1: "),
    ({"prompt": [1.5, 2]}, "prompt", "string or a list of token ids"),
    ({"prompt": [7, 99999]}, "prompt", "[0, 512)"),
    ({"prompt": {"text": "x"}}, "prompt", "string or a list of token ids"),
]

BAD_CHATS = [
    ({}, "messages", "empty"),
    ({"messages": []}, "messages", "empty"),
    ({"messages": "hi"}, "messages", "valid array"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role", "required"),
    ({"messages": [{"role": 3, "content": "hi"}]}, "messages.0.role", "got 3"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role",
     "Input should be 'system', 'developer', 'user', 'assistant', 'tool' or 'function', got \"wizard\""),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "only text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content",
     'a text part needs "text", a string, got None'),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools.0.function", "function is required"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1, got 0"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
    ({"messages": USER, "max_completion_tokens": 500}, "max_completion_tokens", "(plus max_completion_tokens 500)"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true"),
    ({"messages": USER, "top_k": -3}, "top_k", "top_k"),
    ({"messages": USER, "n": 17}, "n", "between 1 and 16, got 17"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "requires logprobs to be true"),
    ({"messages": USER, "logprobs": False, "top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "between 0 and 20, got 21"),
    ({"messages": USER, "logprobs": 1}, "logprobs", "valid boolean"),
]


async def test_whole_numbers_written_as_floats_are_taken_as_integers(client, engine):
    response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3.0, "n": 2.0,
                                                           "seed": 7.0, "logprobs": 1.0})
    assert response.status_code == 200, response.text
    params = engine.added[0].sampling_params
    assert (params.max_tokens, params.n, params.seed, params.logprobs) == (3, 2, 7, 1)
    assert all(type(v) is int for v in (params.max_tokens, params.n, params.seed, params.logprobs))


def assert_openai_error(response, status: int, param: str | None, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"], error["message"]


@pytest.mark.parametrize(("body", "param", "words"), BAD_COMPLETIONS)
async def test_bad_completion_request_is_a_400_with_an_openai_body(client, engine, body, param, words):
    response = await client.post("/v1/completions", json=body)
    assert_openai_error(response, 400, param, words)
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert engine.added == []


@pytest.mark.parametrize(("body", "param", "words"), BAD_CHATS)
async def test_bad_chat_request_is_a_400_with_an_openai_body(client, engine, body, param, words):
    assert_openai_error(await client.post("/v1/chat/completions", json=body), 400, param, words)
    assert engine.added == []


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"a string"'])
async def test_body_that_is_not_a_json_object_is_a_400(client, raw):
    response = await client.post("/v1/completions", content=raw,
                                 headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_json_sent_as_a_form_by_curl_is_still_accepted(client):
    response = await client.post("/v1/completions", content=b'{"prompt": "x"}',
                                 headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200, response.text


async def test_prompt_longer_than_the_context_says_both_numbers(client, config):
    response = await client.post("/v1/completions", json={"prompt": list(range(200))})
    assert_openai_error(response, 400, "prompt",
                        "This model's maximum context length is 128 tokens, but the prompt has 200 tokens")
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_prompt_plus_max_tokens_beyond_the_context_says_all_numbers(client):
    response = await client.post("/v1/completions", json={"prompt": list(range(100)), "max_tokens": 40})
    assert_openai_error(response, 400, "max_tokens", "maximum context length is 128 tokens, "
                        "but the prompt has 100 tokens (plus max_tokens 40)")


async def test_unknown_model_is_a_404_naming_the_served_model(client):
    response = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert_openai_error(response, 404, "model", "`tiny`")
    assert response.json()["error"]["code"] == "model_not_found"


async def test_unknown_path_gets_an_openai_error_body(client):
    response = await client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert "error" in response.json()


async def test_fastapi_validation_errors_are_400_not_422(client):
    app = client._transport.app

    @app.post("/probe")
    async def probe(body: DetokenizeRequest) -> dict:
        return {}

    response = await client.post("/probe", json={"tokens": "nope"})
    assert_openai_error(response, 400, "tokens", "valid list")


async def test_server_keeps_serving_after_every_bad_request(client):
    for body, _, _ in BAD_COMPLETIONS:
        await client.post("/v1/completions", json=body)
    await client.post("/v1/completions", content=b"\xff\xfe garbage")
    response = await client.post("/v1/completions", json={"prompt": "The capital"})
    assert response.status_code == 200


async def test_engine_error_is_a_500_and_a_full_queue_a_429_by_its_code_not_its_text(client, engine):
    engine.fail_with = "worker rank 0 failed: out of memory"
    response = await client.post("/v1/completions", json={"prompt": "x"})
    assert_openai_error(response, 500, None, "out of memory")
    assert response.json()["error"]["type"] == "server_error"
    engine.fail_with = "the waiting queue is full (1024 requests)"  # but with no code: a 500
    response = await client.post("/v1/completions", json={"prompt": "x"})
    assert_openai_error(response, 500, None, "queue is full")
    engine.fail_with, engine.fail_code = "try again later", ERROR_QUEUE_FULL
    response = await client.post("/v1/chat/completions", json={"messages": USER, "n": 2})
    assert_openai_error(response, 429, None, "try again later")
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
    assert response.headers["retry-after"] == "1"
    streamed = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert_openai_error(streamed, 429, None, "try again later")  # a status, not a 200 stream
    assert streamed.headers["retry-after"] == "1"


async def test_a_request_the_scheduler_finds_can_never_run_is_a_400_streamed_or_not(client, engine):
    engine.fail_with = "the request needs up to 2047 tokens of KV cache; the whole KV cache holds 1024"
    engine.fail_code = ERROR_INVALID_REQUEST
    response = await client.post("/v1/chat/completions", json={"messages": USER})
    assert_openai_error(response, 400, None, "whole KV cache holds 1024")
    assert response.json()["error"]["type"] == "invalid_request_error"
    streamed = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert_openai_error(streamed, 400, None, "whole KV cache holds 1024")  # a status, not a 200 stream
    engine.fail_with = ""
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 200


async def test_engine_error_while_streaming_sends_an_error_event_then_done(client, engine, sse):
    engine.fail_with = "worker rank 0 failed"
    response = await client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    events, done = sse(response.text)
    assert done
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["error"]["message"] == "worker rank 0 failed"


async def test_engine_that_is_not_alive_gives_503(client, engine):
    engine.alive = False
    response = await client.post("/v1/completions", json={"prompt": "x"})
    assert_openai_error(response, 503, None, "engine is not available")
    assert engine.added == []


async def test_requests_beyond_the_in_flight_limit_get_429(config, engine, tokenizer, make_http):
    engine.hang = True
    async with make_http(config.with_updates(max_num_seqs=1, max_num_waiting=1)) as http:
        held = [asyncio.create_task(http.post("/v1/completions", json={"prompt": "x"})) for _ in range(2)]
        while len(engine.added) < 2:
            await asyncio.sleep(0.01)
        response = await http.post("/v1/completions", json={"prompt": "x"})
        assert_openai_error(response, 429, None, "the limit is 2")
        for added in engine.added:
            engine.abort(added.request_id)
        assert [r.status_code for r in await asyncio.gather(*held)] == [503, 503]


async def test_api_key_guards_v1_routes_only(config, make_http):
    async with make_http(config.with_updates(api_key="sesame")) as http:
        assert (await http.get("/v1/models")).status_code == 401
        wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert_openai_error(wrong, 401, None, "API key")
        right = await http.get("/v1/models", headers={"Authorization": "Bearer sesame"})
        assert right.status_code == 200
        for header in ("bearer sesame", "BEARER  sesame"):  # the scheme is case-insensitive
            assert (await http.get("/v1/models", headers={"Authorization": header})).status_code == 200
        for header in ("sesame", "Basic sesame", "Bearer sesame2", "Bearersesame"):
            assert (await http.get("/v1/models", headers={"Authorization": header})).status_code == 401
        assert (await http.get("/health")).status_code == 200
