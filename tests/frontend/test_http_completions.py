"""/v1/completions and /v1/chat/completions response shapes, streamed and not, with a fake engine."""

from __future__ import annotations

import pytest

from frontend.protocol import ChatMessage, ChatRendering
from frontend.tools import parse_tools
from frontend.prompt_text import chat_prompt_ids

pytestmark = pytest.mark.anyio


async def test_completion_returns_text_usage_and_finish_reason(client, engine, reply_text):
    response = await client.post("/v1/completions", json={"model": "tiny", "prompt": "The capital",
                                                           "max_tokens": 50, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "text": reply_text, "logprobs": None, "finish_reason": "stop",
                                "prompt_logprobs": None, "stop_reason": None}]  # EOS: no stop string or token id asked
    num_prompt = len(engine.added[0].prompt_token_ids)
    num_reply = len(engine.reply_token_ids)
    assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": num_reply,
                             "total_tokens": num_prompt + num_reply,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.added[0].sampling_params.temperature == 0.0


async def test_completion_cut_by_max_tokens_finishes_with_length(client):
    response = await client.post("/v1/completions", json={"prompt": "The capital", "max_tokens": 3})
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


async def test_completion_accepts_token_ids_and_a_batch_of_one(client, engine):
    for prompt in ([5, 6, 7], [[5, 6, 7]], ["The capital"]):
        response = await client.post("/v1/completions", json={"prompt": prompt})
        assert response.status_code == 200, response.text
    assert engine.added[0].prompt_token_ids == [5, 6, 7]
    assert engine.added[1].prompt_token_ids == [5, 6, 7]


async def test_completion_max_tokens_defaults_to_openai_16(client, engine):
    await client.post("/v1/completions", json={"prompt": "The capital"})
    assert engine.added[0].sampling_params.max_tokens == 16


async def test_chat_max_tokens_defaults_to_the_rest_of_the_context(client, engine, config):
    await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    added = engine.added[0]
    assert added.sampling_params.max_tokens == config.max_model_len - len(added.prompt_token_ids)


async def test_sampling_fields_and_vllm_extensions_reach_the_engine(client, engine):
    request = {"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "seed": 11, "presence_penalty": 0.5, "frequency_penalty": -0.5,
               "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True,
               "stop_token_ids": [2], "logit_bias": {"17": -100}, "user": "u", "max_tokens": 8}
    response = await client.post("/v1/completions", json=request)
    assert response.status_code == 200, response.text
    params = engine.added[0].sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 20, 0.05)
    assert params.seed == 11
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (params.min_tokens, params.ignore_eos, params.stop_token_ids) == (2, True, (2,))
    assert params.logit_bias == ((17, -100.0),)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_token_that_ends_the_output_counts_but_its_text_is_left_out(
        config, engine, tokenizer, make_http, sse, stream):
    engine.reply_token_ids = tokenizer.encode("Paris.", add_special_tokens=False)
    period, eos = engine.reply_token_ids[-1], engine.reply_token_ids[0]
    async with make_http(config.with_updates(eos_token_ids=(eos,))) as client:
        async def text_and_usage(**fields: object) -> tuple[str, int]:
            body = {"prompt": "The capital", "max_tokens": 20, "stream": stream,
                    "stream_options": {"include_usage": True} if stream else None, **fields}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            if not stream:
                return response.json()["choices"][0]["text"], response.json()["usage"]["completion_tokens"]
            events, _ = sse(response.text)
            return "".join(c["text"] for e in events for c in e["choices"]), events[-1]["usage"]["completion_tokens"]

        num_reply = len(engine.reply_token_ids)
        full = tokenizer.decode(engine.reply_token_ids)
        assert await text_and_usage(stop_token_ids=[period]) == (full.removesuffix("."), num_reply)
        assert await text_and_usage(stop_token_ids=[period], include_stop_str_in_output=True) == (full, num_reply)
        assert (await text_and_usage(stop="ari"))[0] == "P"
        assert (await text_and_usage(stop="ari", include_stop_str_in_output=True))[0] == "Pari"
        assert await text_and_usage() == (full, num_reply)  # a stop without a stop token keeps its text
        engine.reply_token_ids = engine.reply_token_ids[1:] + [eos]  # ends with the model's EOS
        assert await text_and_usage() == (tokenizer.decode(engine.reply_token_ids[:-1]), num_reply)
        # With ignore_eos the EOS is just a token, even in an output that then stops (on a grammar)
        assert await text_and_usage(ignore_eos=True) == (tokenizer.decode(engine.reply_token_ids), num_reply)


async def test_streamed_completion_sends_text_chunks_then_finish_then_done(client, reply_text, sse):
    response = await client.post("/v1/completions", json={"prompt": "The capital", "max_tokens": 50,
                                                           "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events, done = sse(response.text)
    assert done
    assert all(e["object"] == "text_completion" and e["id"].startswith("cmpl-") for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == reply_text
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "stop"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert all("usage" not in e for e in events)


async def test_streamed_completion_with_include_usage_ends_with_a_usage_chunk(client, engine, sse):
    response = await client.post("/v1/completions", json={
        "prompt": "The capital", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    events, done = sse(response.text)
    assert done
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    num_prompt = len(engine.added[0].prompt_token_ids)
    assert events[-1]["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 4,
                                   "total_tokens": num_prompt + 4,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


async def test_chat_completion_returns_an_assistant_message(client, engine, reply_text, tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Capital"},
                                             {"type": "text", "text": "of France?"}]}]
    response = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": reply_text}
    assert body["choices"][0]["finish_reason"] == "stop"
    expected_prompt = tokenizer.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital\nof France?<|im_end|>\n"
        "<|im_start|>assistant\n", add_special_tokens=False)
    assert engine.added[0].prompt_token_ids == expected_prompt
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)


async def test_chat_max_completion_tokens_wins_over_max_tokens(client, engine):
    await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 3})
    assert engine.added[0].sampling_params.max_tokens == 3


async def test_streamed_chat_starts_with_the_assistant_role_and_ends_with_done(client, reply_text, sse):
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}})
    events, done = sse(response.text)
    assert done
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert content == reply_text
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                        "stop_reason": None}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0


async def test_models_lists_the_served_name(client, config):
    body = (await client.get("/v1/models")).json()
    assert [card["id"] for card in body["data"]] == ["tiny"]
    assert body["data"][0]["max_model_len"] == config.max_model_len


async def test_a_model_is_retrieved_by_its_name_with_slashes_and_another_is_a_404(client, config, make_http):
    listed = (await client.get("/v1/models")).json()["data"][0]
    assert (await client.get("/v1/models/tiny")).json() == listed
    missing = await client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    async with make_http(config.with_updates(served_model_name="org/tiny-chat")) as http:
        assert (await http.get("/v1/models/org/tiny-chat")).json()["id"] == "org/tiny-chat"


async def test_tokenize_and_detokenize_round_trip(client, tokenizer):
    body = (await client.post("/tokenize", json={"prompt": "Héllo wörld"})).json()
    assert body["tokens"] == tokenizer.encode("Héllo wörld")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 128
    text = (await client.post("/detokenize", json={"tokens": body["tokens"]})).json()
    assert text == {"prompt": "Héllo wörld"}
    chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
    assert chat["tokens"] == tokenizer.encode_chat([{"role": "user", "content": "hi"}])


async def test_tokenize_renders_tools_into_the_chat_prompt_as_the_chat_endpoint_does(client, tokenizer, config):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]
    with_tools = (await client.post("/tokenize", json={"messages": messages, "tools": tools})).json()
    expected = chat_prompt_ids([ChatMessage(**m) for m in messages], tokenizer, ChatRendering(), config.max_model_len,
                               parse_tools(tools, None))
    assert with_tools["tokens"] == expected
    assert "get_weather" in tokenizer.decode(with_tools["tokens"])
    plain = (await client.post("/tokenize", json={"messages": messages})).json()
    assert plain["count"] < with_tools["count"]
    refused = await client.post("/tokenize", json={"prompt": "hi", "tools": tools})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    bad = await client.post("/tokenize", json={"messages": messages, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools.0.function"


async def test_version_reports_a_version(client):
    assert "version" in (await client.get("/version")).json()


async def test_a_response_carries_the_clients_x_request_id_or_its_own_id(client, sse):
    mine = await client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "trace-7"})
    assert mine.headers["x-request-id"] == "trace-7"
    streamed = await client.post("/v1/chat/completions", headers={"X-Request-Id": "trace-8"},
                                 json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert streamed.headers["x-request-id"] == "trace-8"
    own = await client.post("/v1/completions", json={"prompt": "x"})
    assert own.headers["x-request-id"] == own.json()["id"]



@pytest.mark.parametrize("stream", [False, True])
async def test_stop_reason_names_the_stop_string_or_stop_token_id_that_ended_a_choice(
        client, engine, tokenizer, sse, stream):
    last = engine.reply_token_ids[-1]  # the fake engine's reply ends on its last token, finish "stop"
    cases = [({"stop": [" capital", "zzz"]}, " capital"), ({"stop_token_ids": [last]}, last), ({}, None)]
    for fields, stop_reason in cases:
        response = await client.post("/v1/completions", json={"prompt": "x", "stream": stream, **fields})
        if stream:
            events, _ = sse(response.text)
            choice = next(c for e in events for c in e["choices"] if c["finish_reason"])
        else:
            choice = response.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_reason), fields
