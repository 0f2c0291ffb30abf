"""Hostile and odd requests at the HTTP edge: each gets a 4xx with an OpenAI error body (or works)
within a second, and the server serves the next request."""

from __future__ import annotations

import time

import pytest

from frontend.app import create_app
from proto.messages import ERROR_WAITING_TOKENS_FULL

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hi"}]
HUGE = 10**20
DEEP = 100_000
ONE_MILLION_TOKENS = "hello world " * 500_000  # 6 MB of text; far more than 10^6 tokens here

# (path, raw JSON body, status, param, words the message must contain)
BATTERY = [
    ("/v1/completions", b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, None, "not valid JSON"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi", "x": '
     + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}]}", 400, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e400}', 400, "temperature", "<= 100.0, got inf"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "NaN"),
    ("/v1/completions", b'{"prompt": "x", "top_p": -0.0}', 400, "top_p", "(0, 1]"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -0}', 400, "max_tokens", ">= 1, got 0 (0 only with echo"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": %d}' % HUGE, 400, "max_tokens",
     "maximum context length is 128 tokens"),
    ("/v1/completions", b'{"prompt": "x", "n": %d}' % HUGE, 400, "n", f"between 1 and 16, got {HUGE}"),
    ("/v1/completions", b'{"prompt": "x", "top_k": %d}' % HUGE, 400, "top_k",
     f"in [1, 512] (the vocabulary size), got {HUGE}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_k": -%d}' % HUGE,
     400, "top_k", "-1 or 0 (disabled)"),
    ("/v1/completions", b'{"prompt": "x", "seed": %d}' % HUGE, 400, "seed", "<= 9223372036854775807"),
    ("/v1/completions", b'{"prompt": "x", "stop_token_ids": [%d]}' % HUGE, 400, "stop_token_ids",
     "out of range"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"abc": 1}}', 400, "logit_bias", "token ids"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"²": 1}}'.encode(), 400, "logit_bias", "token ids"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"-1": 1}}', 400, "logit_bias", "token ids"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"%s": 1}}' % (b"7" * 5000), 400, "logit_bias",
     "out of range for a vocabulary of 512"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"99999": 1}}', 400, "logit_bias", "out of range"),
    ("/v1/completions", b'{"prompt": "caf\xc3\x28 \xff\xfe"}', 400, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}', 400, None,
     "not valid JSON: a \\uD800-\\uDFFF escape must be half of a surrogate pair"),
    ("/v1/completions", b'{"prompt": "lone \\udc00 low half"}', 400, None, "(a lone surrogate is not a Unicode "
     "character) at line 1 column"),
    ("/v1/completions", b'{"prompt": %s}' % str([1] * 1_000_000).encode(), 400, "prompt",
     "maximum context length is 128 tokens, but the prompt has 1000000 tokens"),
    ("/v1/completions", b'{"prompt": "%s"}' % ONE_MILLION_TOKENS.encode(), 400, "prompt",
     "but the prompt has at least 461539 tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "%s"}]}'
     % ONE_MILLION_TOKENS.encode(), 400, "messages", "prompt has at least"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages", "must not be empty"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400,
     "messages.0.role", "got \"wizard\""),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"response_format": {"type": "xml"}}', 400, "response_format.type", "'json_schema', got \"xml\""),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"structured_outputs": {"regex": "(ab"}}', 400, "structured_outputs.regex", "cannot be used"),
    ("/v1/completions", b'{"prompt": "x", "response_format": {"type": "json_schema", '
     b'"json_schema": {"name": "a", "schema": {"not": {"type": "string"}}}}}', 400,
     "response_format.json_schema.schema", "Unimplemented keys"),
    ("/tokenize", b'{"prompt": "%s"}' % ONE_MILLION_TOKENS.encode(), 400, "prompt", "at least"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "words"), BATTERY,
                         ids=[f"{case[0]} {case[4]}"[:60] for case in BATTERY])
async def test_hostile_body_gets_its_4xx_within_a_second_and_the_next_request_works(
        client, engine, path, body, status, param, words):
    started_s = time.monotonic()
    response = await client.post(path, content=body, headers={"content-type": "application/json"})
    elapsed_s = time.monotonic() - started_s
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert elapsed_s < 1.0, f"{elapsed_s:.2f} s"
    assert engine.added == []
    assert (await client.post("/v1/completions", json={"prompt": "The capital"})).status_code == 200


@pytest.mark.parametrize("body", [
    {"messages": USER, "response_format": {"type": "text"}},
    {"messages": [{"role": "developer", "content": "Be brief."}, *USER]},
    {"messages": USER, "max_tokens": 5, "logit_bias": {"0007": 2.5}},
])
async def test_odd_but_valid_requests_work(client, engine, body):
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


async def test_a_temperature_of_minus_zero_is_greedy(client, engine):
    response = await client.post("/v1/completions", content=b'{"prompt": "x", "temperature": -0.0}')
    assert response.status_code == 200, response.text
    assert engine.added[-1].sampling_params.temperature == 0.0


async def test_content_given_as_text_parts_is_the_text_the_template_sees(client, engine, tokenizer):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]
    response = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    assert response.status_code == 200, response.text
    plain = tokenizer.encode_chat([{"role": "user", "content": "What is\nthe capital?"}])
    assert engine.added[-1].prompt_token_ids == plain
    assert response.json()["choices"][0]["message"]["content"] == "Paris is the capital of France."


async def test_a_body_over_the_limit_is_a_413_naming_the_limit(config, make_http):
    async with make_http(config.with_updates(max_request_body_bytes=1000)) as http:
        response = await http.post("/v1/completions", json={"prompt": "x" * 2000})
        assert response.status_code == 413
        assert "Content-Length is 2013 bytes and the limit is 1000 bytes (--max-request-body-size)" in (
            response.json()["error"]["message"])

        async def chunks():  # no Content-Length: counted as it arrives
            for _ in range(20):
                yield b"x" * 100

        response = await http.post("/v1/completions", content=chunks())
        assert response.status_code == 413
        assert "longer than the limit of 1000 bytes" in response.json()["error"]["message"]
        assert (await http.post("/v1/completions", json={"prompt": "x"})).status_code == 200


async def test_tokenizing_a_long_prompt_leaves_health_answering(config, engine, tokenizer, make_http):
    """The tokenizer works in a thread without the GIL: /health keeps answering meanwhile."""
    import asyncio

    prompt = "hello world " * 60_000  # about a second of tokenizing on this machine
    async with make_http(config.with_updates(max_model_len=10**7)) as http:
        assert (await http.post("/v1/completions", json={"prompt": "warm"})).status_code == 200
        started_s = time.monotonic()
        long_request = asyncio.create_task(http.post("/v1/completions", json={"prompt": prompt}))
        worst_s, answered_s = 0.0, time.monotonic()
        while not long_request.done():  # the gaps include the sleeps: a loop held up shows
            await asyncio.sleep(0.01)
            assert (await http.get("/health")).status_code == 200
            worst_s = max(worst_s, time.monotonic() - answered_s)
            answered_s = time.monotonic()
        tokenizing_s = time.monotonic() - started_s
        assert (await long_request).status_code == 200
    assert len(engine.added[1].prompt_token_ids) > 100_000
    assert worst_s < 0.25 < tokenizing_s, (worst_s, tokenizing_s)


def test_the_app_shuts_its_preparing_threads_down_with_its_lifespan(config, engine, tokenizer):
    from fastapi.testclient import TestClient

    app = create_app(config, engine, tokenizer)
    with TestClient(app) as http:
        assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    with pytest.raises(RuntimeError):
        app.state.conveyor.prepare_pool.submit(print)


async def test_a_queue_the_scheduler_reports_full_is_refused_before_the_body_is_parsed(
        config, engine, make_http):
    engine.num_waiting, engine.num_waiting_tokens = 3, 40  # what the fake scheduler reports
    async with make_http(config.with_updates(max_num_waiting=4, max_waiting_tokens=40)) as http:
        assert (await http.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        refused = await http.post("/v1/completions", content=b"{not even json")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "40 prompt tokens are waiting and max_waiting_tokens is 40" in refused.json()["error"]["message"]
        engine.num_waiting_tokens = 0
        engine.heartbeat()  # the scheduler's next word says there is room again
        parsed = await http.post("/v1/completions", content=b"{not even json")  # 3 waiting, not 4
        assert parsed.status_code == 400
        metrics = (await http.get("/metrics")).text
    assert 'conveyor:request_rejected_total{model_name="tiny",reason="max_waiting_tokens"} 1.0' in metrics


async def test_waiting_sequences_that_free_seats_will_take_do_not_fill_the_queue_at_the_door(config, engine, make_http):
    engine.num_running, engine.num_waiting = 2, 5  # what the fake scheduler reports
    async with make_http(config.with_updates(max_num_seqs=4, max_num_waiting=4)) as http:
        assert (await http.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        assert (await http.post("/v1/completions", json={"prompt": "x"})).status_code == 200  # 5 < 4 + 2 free
        engine.num_running = 4
        engine.heartbeat()
        refused = await http.post("/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 429
        assert "max_num_waiting is 4 (beyond 0 free seats)" in refused.json()["error"]["message"]


async def test_a_scheduler_refusal_by_waiting_tokens_is_a_429_counted_under_its_limit(client, engine):
    engine.fail_with, engine.fail_code = "the waiting queue is full: 900 prompt tokens", ERROR_WAITING_TOKENS_FULL
    response = await client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "queue_full"
    metrics = (await client.get("/metrics")).text
    assert 'conveyor:request_rejected_total{model_name="tiny",reason="max_waiting_tokens"} 1.0' in metrics
