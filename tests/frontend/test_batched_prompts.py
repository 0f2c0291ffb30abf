"""/v1/completions with a list of prompts: one engine request each, choices numbered prompt by prompt."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from frontend.app import create_app
from frontend.generation import Generation
from proto.messages import ERROR_QUEUE_FULL

pytestmark = pytest.mark.anyio


async def test_a_batch_numbers_its_choices_prompt_by_prompt_and_sums_its_usage(client, engine, tokenizer):
    response = await client.post("/v1/completions", json={
        "prompt": ["The capital", "x y"], "n": 2, "echo": True, "max_tokens": 3, "seed": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    reply = tokenizer.decode(engine.reply_token_ids[:3])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "The capital" + reply), (1, "The capital" + reply), (2, "x y" + reply), (3, "x y" + reply)]
    assert [a.prompt_token_ids for a in engine.added] == [tokenizer.encode("The capital"), tokenizer.encode("x y")]
    assert len({a.request_id for a in engine.added}) == 2 and body["id"].startswith("cmpl-")
    assert all(a.sampling_params.seed == 5 and a.sampling_params.n == 2 for a in engine.added)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(engine.added[0].prompt_token_ids) + len(engine.added[1].prompt_token_ids)
    assert usage["completion_tokens"] == 4 * 3


async def test_a_streamed_batch_sends_every_choice_under_one_id_and_ends_each_once(client, engine, tokenizer, sse):
    response = await client.post("/v1/completions", json={
        "prompt": [[5, 6, 7], [8, 9], [10]], "stream": True, "stream_options": {"include_usage": True}})
    events, done = sse(response.text)
    assert done and len({e["id"] for e in events}) == 1
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert texts == {i: tokenizer.decode(engine.reply_token_ids) for i in range(3)}
    assert finishes == {i: ["stop"] for i in range(3)}
    assert events[-1]["usage"]["prompt_tokens"] == 6


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_prompt_fails_the_whole_batch_and_aborts_the_others(client, engine, stream):
    engine.hang = True  # the first prompt would run on
    engine.fail_with, engine.fail_code, engine.fail_from = "the waiting queue is full", ERROR_QUEUE_FULL, 1
    response = await client.post("/v1/completions", json={"prompt": ["a", "b"], "stream": stream})
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "queue_full"
    assert engine.added[0].request_id in engine.aborted


async def test_a_prompt_that_fails_while_running_fails_the_batch_and_aborts_the_rest(client, engine):
    engine.hang = True
    engine.fail_with, engine.fail_from = "the worker failed a step", 1
    response = await client.post("/v1/completions", json={"prompt": ["a", "b"]})
    assert response.status_code == 500 and "worker failed a step" in response.json()["error"]["message"]
    assert engine.added[0].request_id in engine.aborted


async def test_a_batch_of_one_is_answered_as_its_only_prompt(client, engine):
    body = (await client.post("/v1/completions", json={"prompt": ["The capital"], "n": 2})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert len(engine.added) == 1 and engine.added[0].request_id == body["id"]


async def test_a_prompt_whose_handling_raises_fails_the_batch_and_aborts_the_others(config, engine, tokenizer,
                                                                                  monkeypatch):

    consume = Generation._consume

    def broken_for_the_second(self, delta):
        if self.request_id.endswith("-1"):
            raise RuntimeError("a bug in the output path")
        return consume(self, delta)

    monkeypatch.setattr(Generation, "_consume", broken_for_the_second)
    engine.hang = True  # the first prompt would run on
    transport = httpx.ASGITransport(app=create_app(config, engine, tokenizer), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://conveyor.test") as http:
        response = await asyncio.wait_for(http.post("/v1/completions", json={"prompt": ["a", "b"]}), 10.0)
        metrics = (await http.get("/metrics")).text
    assert response.status_code == 500
    assert engine.added[0].request_id in engine.aborted
    assert ('conveyor:http_requests_total{handler="/v1/completions",method="POST",model_name="tiny",status="500"} 1.0'
            in metrics)


async def test_a_batch_the_server_can_never_hold_at_once_is_a_400_naming_the_limits(config, make_http):
    async with make_http(config.with_updates(max_num_seqs=2, max_num_waiting=2)) as http:
        response = await http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2})
        assert response.status_code == 400
        assert "6 sequences (prompts x n)" in response.json()["error"]["message"]
        assert "--max-num-seqs 2 + --max-num-waiting 2" in response.json()["error"]["message"]
        fits = await http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2})
        assert fits.status_code == 200, fits.text


async def test_a_request_level_error_in_a_batch_is_not_blamed_on_a_prompt(client):
    response = await client.post("/v1/completions", json={"prompt": ["a", "b"], "stream_options": {}})
    assert response.json()["error"]["message"] == "stream_options is only allowed with stream: true"
