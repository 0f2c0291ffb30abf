"""n choices, logprobs (completions and chat shapes), echo and cached tokens, with a fake engine."""

from __future__ import annotations

import asyncio

import pytest
from frontend_fakes import prompt_logprob, sampled_logprob

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hi"}]


def by_index(events: list[dict], key: str) -> dict[int, list[dict]]:
    """Stream chunk choices grouped by their `index` (events without choices are left out)."""
    grouped: dict[int, list[dict]] = {}
    for event in events:
        for choice in event.get("choices", []):
            grouped.setdefault(choice["index"], []).append(choice)
    return grouped


async def test_completion_with_n_returns_n_choices_and_sums_their_tokens(client, engine, tokenizer):
    engine.choice_replies = [engine.reply_token_ids, engine.reply_token_ids[:3]]
    response = await client.post("/v1/completions", json={"prompt": "The capital", "n": 2,
                                                           "max_tokens": 50, "seed": 7})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == tokenizer.decode(engine.reply_token_ids)
    assert body["choices"][1]["text"] == tokenizer.decode(engine.reply_token_ids[:3])
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop"]
    num_prompt = len(engine.added[0].prompt_token_ids)
    assert body["usage"]["prompt_tokens"] == num_prompt
    assert body["usage"]["completion_tokens"] == len(engine.reply_token_ids) + 3
    params = engine.added[0].sampling_params
    assert (params.n, params.seed) == (2, 7)


async def test_chat_with_n_returns_n_assistant_messages(client, engine, reply_text):
    response = await client.post("/v1/chat/completions", json={"messages": USER, "n": 3})
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"] == {"role": "assistant", "content": reply_text} for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 3 * len(engine.reply_token_ids)


async def test_streamed_choices_interleave_with_their_index_and_finish_once_each(
        client, engine, tokenizer, sse):
    engine.choice_replies = [engine.reply_token_ids[:4], engine.reply_token_ids]
    response = await client.post("/v1/completions", json={"prompt": "x", "n": 2, "stream": True,
                                                           "max_tokens": 50})
    events, done = sse(response.text)
    assert done
    choices = by_index(events, "text")
    assert "".join(c["text"] for c in choices[0]) == tokenizer.decode(engine.reply_token_ids[:4])
    assert "".join(c["text"] for c in choices[1]) == tokenizer.decode(engine.reply_token_ids)
    for index in (0, 1):
        assert [c["finish_reason"] for c in choices[index] if c["finish_reason"]] == ["stop"]
    order = [c["index"] for e in events for c in e["choices"]]
    assert order.index(1) < max(i for i, index in enumerate(order) if index == 0)  # interleaved


async def test_streamed_chat_announces_the_role_of_every_choice_first(client, sse):
    response = await client.post("/v1/chat/completions", json={"messages": USER, "n": 2,
                                                                "stream": True})
    events, _ = sse(response.text)
    assert [e["choices"][0] for e in events[:2]] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None} for i in (0, 1)]


async def test_stop_string_in_one_choice_does_not_cut_its_sibling(client, engine, tokenizer):
    reply = engine.reply_token_ids  # "Paris is the capital of France."
    sibling_text = " and the quick brown fox jumps over the lazy dog again"
    sibling = tokenizer.encode(sibling_text, add_special_tokens=False)
    assert len(sibling) > len(reply)  # the sibling runs on after choice 0's stop string
    engine.choice_replies = [reply, sibling]
    response = await client.post("/v1/completions", json={"prompt": "x", "n": 2, "stop": " capital",
                                                           "max_tokens": 50})
    choices = response.json()["choices"]
    assert (choices[0]["text"], choices[0]["finish_reason"]) == ("Paris is the", "stop")
    assert (choices[1]["text"], choices[1]["finish_reason"]) == (sibling_text, "stop")
    assert response.json()["usage"]["completion_tokens"] < len(reply) + len(sibling)
    assert engine.aborted == []  # choice 0's sequence had ended in the engine before choice 1's
    assert engine.aborted_choices == [(engine.added[0].request_id, 0)]


async def test_a_choice_that_meets_its_stop_string_is_aborted_alone_while_its_sibling_runs_on(
        client, engine, tokenizer):
    engine.hang = True  # the engine runs each choice until it is aborted or told to finish
    sibling_text = " and the quick brown fox jumps over the lazy dog again"
    engine.choice_replies = [engine.reply_token_ids, tokenizer.encode(sibling_text, add_special_tokens=False)]
    pending = asyncio.create_task(client.post("/v1/completions", json={
        "prompt": "x", "n": 2, "stop": " capital", "max_tokens": 50}))
    while not engine.aborted_choices:
        await asyncio.sleep(0.01)
    request_id = engine.added[0].request_id
    assert engine.aborted_choices == [(request_id, 0)] and engine.aborted == []
    assert not pending.done()  # choice 1 still runs
    engine.finish_running(request_id, "stop")
    response = await asyncio.wait_for(pending, 5)
    choices = response.json()["choices"]
    assert (choices[0]["text"], choices[0]["finish_reason"]) == ("Paris is the", "stop")
    assert (choices[1]["text"], choices[1]["finish_reason"]) == (sibling_text, "stop")
    assert engine.aborted == []  # both sequences had ended in the engine: nothing to abort


async def test_request_is_aborted_once_every_choice_met_its_stop_string(client, engine):
    engine.hang = True  # the engine would run both choices forever
    response = await client.post("/v1/completions", json={"prompt": "x", "n": 2, "stop": " capital",
                                                           "max_tokens": 50})
    assert [c["text"] for c in response.json()["choices"]] == ["Paris is the", "Paris is the"]
    assert engine.aborted == [engine.added[0].request_id]
    assert engine.aborted_choices == [(engine.added[0].request_id, 0)]  # the last one ends it all


async def test_client_abort_ends_every_choice(client, engine):
    engine.hang = True
    held = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "n": 3}))
    while not engine.added:
        await asyncio.sleep(0.01)
    engine.abort(engine.added[0].request_id)
    response = await held
    assert response.status_code == 503 and response.json()["error"]["code"] == "aborted"


async def test_completion_logprobs_have_the_legacy_openai_shape(client, engine, tokenizer):
    response = await client.post("/v1/completions", json={"prompt": "The capital", "logprobs": 2,
                                                           "max_tokens": 50})
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    reply, num_prompt = engine.reply_token_ids, len(engine.added[0].prompt_token_ids)
    assert engine.added[0].sampling_params.logprobs == 2
    assert engine.added[0].sampling_params.prompt_logprobs == -1
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"] == pytest.approx(
        [sampled_logprob(num_prompt + j, 0) for j in range(len(reply))])
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert len(top) == 2 and token in top  # the top 2, the token itself among them
    offsets = [sum(len(t) for t in logprobs["tokens"][:j]) for j in range(len(reply))]
    assert logprobs["text_offset"] == offsets


async def test_echo_with_logprobs_prepends_the_prompt_and_its_logprobs(client, engine, tokenizer):
    response = await client.post("/v1/completions", json={
        "prompt": "The capital", "echo": True, "logprobs": 1, "max_tokens": 3})
    choice = response.json()["choices"][0]
    prompt_ids = engine.added[0].prompt_token_ids
    assert engine.added[0].sampling_params.prompt_logprobs == 1
    assert choice["text"] == "The capital" + tokenizer.decode(engine.reply_token_ids[:3])
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(prompt_ids)] == pytest.approx(
        [prompt_logprob(p) for p in range(1, len(prompt_ids))])
    assert logprobs["token_logprobs"][len(prompt_ids)] == pytest.approx(
        sampled_logprob(len(prompt_ids), 0))
    assert "".join(logprobs["tokens"]) == choice["text"]


async def test_echo_without_logprobs_only_prepends_the_prompt(client, engine, tokenizer):
    response = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "echo": True,
                                                           "max_tokens": 2})
    choice = response.json()["choices"][0]
    assert choice["text"] == tokenizer.decode([5, 6, 7]) + tokenizer.decode(engine.reply_token_ids[:2])
    assert choice["logprobs"] is None
    assert engine.added[0].sampling_params.prompt_logprobs == -1


@pytest.mark.parametrize("logprobs", [None, 2])
async def test_echo_with_max_tokens_0_returns_the_prompt_alone_to_score_it(client, engine, tokenizer, logprobs):
    response = await client.post("/v1/completions", json={"prompt": "The capital", "echo": True,
                                                           "max_tokens": 0, "logprobs": logprobs, "n": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt_ids = engine.added[0].prompt_token_ids
    assert engine.added[0].sampling_params.max_tokens == 1  # the engine samples one, the response leaves it out
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [("The capital", "length")] * 2
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] == len(prompt_ids)
    if logprobs is None:
        assert body["choices"][0]["logprobs"] is None
        return
    shape = body["choices"][0]["logprobs"]
    assert shape["tokens"] == [tokenizer.token_text(t) for t in prompt_ids]
    assert shape["token_logprobs"][1:] == pytest.approx([prompt_logprob(p) for p in range(1, len(prompt_ids))])


@pytest.mark.parametrize("max_tokens", [0, 3])
@pytest.mark.parametrize("logprobs", [None, 1])
async def test_a_streamed_echo_carries_what_the_unstreamed_one_does(client, engine, sse, max_tokens, logprobs):
    """The prompt (and its logprobs) lead each choice's first chunk, as vLLM streams them; joined, the
    chunks give the unstreamed choice's text, logprobs and finish reason."""
    body = {"prompt": "The capital", "echo": True, "max_tokens": max_tokens, "logprobs": logprobs, "n": 2}
    whole = (await client.post("/v1/completions", json=body)).json()["choices"]
    response = await client.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    events, done = sse(response.text)
    assert done
    for index, chunks in by_index(events, "text").items():
        assert chunks[0]["text"].startswith("The capital")
        assert "".join(c["text"] for c in chunks) == whole[index]["text"]
        assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == [whole[index]["finish_reason"]]
        if logprobs is None:
            assert all(c["logprobs"] is None for c in chunks)
            continue
        joined = {key: [item for c in chunks if c["logprobs"] for item in c["logprobs"][key]]
                  for key in ("tokens", "token_logprobs", "text_offset")}
        expected = whole[index]["logprobs"]
        assert joined["tokens"] == expected["tokens"] and joined["text_offset"] == expected["text_offset"]
        assert joined["token_logprobs"] == pytest.approx(expected["token_logprobs"], nan_ok=True)


async def test_max_tokens_0_without_echo_is_refused_naming_the_limit(client, engine):
    response = await client.post("/v1/completions", json={"prompt": "The capital", "max_tokens": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens" and "got 0" in response.json()["error"]["message"]
    assert not engine.added


@pytest.mark.parametrize("prompt", [["The capital"], [[5, 6, 7]]])
async def test_echo_of_a_batch_of_one_prepends_its_only_prompt(client, engine, tokenizer, prompt):
    response = await client.post("/v1/completions", json={"prompt": prompt, "echo": True,
                                                           "max_tokens": 2})
    only = prompt[0]
    prompt_text = only if isinstance(only, str) else tokenizer.decode(only)
    choice = response.json()["choices"][0]
    assert choice["text"] == prompt_text + tokenizer.decode(engine.reply_token_ids[:2])


async def test_chat_logprobs_list_each_token_with_bytes_and_its_top_k(client, engine, tokenizer):
    response = await client.post("/v1/chat/completions", json={
        "messages": USER, "logprobs": True, "top_logprobs": 3, "n": 2, "max_tokens": 4})
    body = response.json()
    num_prompt = len(engine.added[0].prompt_token_ids)
    for choice in body["choices"]:
        content = choice["logprobs"]["content"]
        assert [item["token"] for item in content] == [
            tokenizer.token_text(t) for t in engine.reply_token_ids[:4]]
        assert "".join(item["token"] for item in content) == choice["message"]["content"]
        assert [item["logprob"] for item in content] == pytest.approx(
            [sampled_logprob(num_prompt + j, choice["index"]) for j in range(4)])
        for item in content:
            assert bytes(item["bytes"]).decode() == item["token"]
            tops = item["top_logprobs"]
            assert len(tops) == 3 and tops[0]["token"] == item["token"]
            assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)


async def test_chat_logprobs_without_top_logprobs_ask_for_no_alternatives(client, engine):
    response = await client.post("/v1/chat/completions", json={"messages": USER, "logprobs": True,
                                                                "max_tokens": 2})
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert engine.added[0].sampling_params.logprobs == 0
    assert [item["top_logprobs"] for item in content] == [[], []]


async def test_streamed_logprobs_cover_every_token_exactly_once(client, engine, sse):
    engine.tokens_per_step = 2
    response = await client.post("/v1/completions", json={"prompt": "x", "logprobs": 0,
                                                           "max_tokens": 50, "stream": True})
    events, _ = sse(response.text)
    chunks = [c["logprobs"] for c in by_index(events, "text")[0] if c["logprobs"]]
    tokens = [t for chunk in chunks for t in chunk["tokens"]]
    offsets = [o for chunk in chunks for o in chunk["text_offset"]]
    assert len(tokens) == len(engine.reply_token_ids)
    assert offsets == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
    response = await client.post("/v1/chat/completions", json={
        "messages": USER, "logprobs": True, "stream": True, "max_tokens": 50})
    events, _ = sse(response.text)
    content = [item for c in by_index(events, "delta")[0] if c["logprobs"]
               for item in c["logprobs"]["content"]]
    assert len(content) == len(engine.reply_token_ids)


async def test_prefix_cache_hits_are_reported_as_cached_tokens(client, engine, sse):
    engine.num_cached_tokens = 3
    body = (await client.post("/v1/completions", json={"prompt": "The capital", "n": 2})).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    response = await client.post("/v1/chat/completions", json={
        "messages": USER, "stream": True, "stream_options": {"include_usage": True}})
    events, _ = sse(response.text)
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


async def test_engine_error_in_n_choices_fails_the_request(client, engine):
    engine.fail_with = "worker rank 0 failed"
    response = await client.post("/v1/completions", json={"prompt": "x", "n": 2})
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "worker rank 0 failed"


@pytest.mark.parametrize("stream", [False, True])
async def test_one_failing_choice_aborts_its_siblings_at_once_and_the_request_reports_its_error(
        client, engine, sse, stream):
    engine.hang = True  # every choice runs until told
    answer = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "n": 3, "stream": stream}))
    while not engine.added:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    request_id = engine.added[0].request_id
    engine.finish_running(request_id, "error", choices=(1,), error_message="choice 1's grammar failed")
    response = await asyncio.wait_for(answer, 10)
    assert engine.aborted == [request_id]  # choices 0 and 2 freed at once, not run to their end
    if stream:
        events, done = sse(response.text)
        assert done and events[-1]["error"]["message"] == "choice 1's grammar failed"
    else:
        assert response.status_code == 500 and response.json()["error"]["message"] == "choice 1's grammar failed"
