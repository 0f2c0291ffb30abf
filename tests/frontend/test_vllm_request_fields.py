"""vLLM's request extensions: those conveyor implements take effect; the others are a 400 naming
the field, never a 200 that silently ignores what the client asked for."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.anyio
IDS = list(range(10, 40))  # a 30-token prompt


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value", [
    ("use_beam_search", True), ("logits_processors", ["x"])])
async def test_an_unimplemented_vllm_field_is_a_400_naming_it(client, engine, endpoint, field, value):
    prompt = {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    response = await client.post(endpoint, json={**prompt, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field} is not supported")
    assert not engine.added


@pytest.mark.parametrize("field, value", [("spaces_between_special_tokens", 1), ("use_beam_search", 0),
                                          ("return_tokens_as_token_ids", "false")])
async def test_a_boolean_vllm_field_takes_only_a_boolean(client, engine, field, value):
    response = await client.post("/v1/completions", json={"prompt": "x", field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "valid boolean" in error["message"]
    assert not engine.added


@pytest.mark.parametrize("field, value, instead", [
    ("functions", [{"name": "f", "parameters": {}}], "send them as tools"), ("function_call", "auto", "tool_choice"),
    ("chat_template", "{{ messages }}", "the model's own chat template"), ("echo", True, "/v1/completions")])
async def test_a_chat_field_conveyor_does_not_implement_is_a_400_naming_it(client, engine, field, value, instead):
    response = await client.post("/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "x"}], field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field} is not supported") and instead in \
        error["message"]
    assert not engine.added
    harmless = {"messages": [{"role": "user", "content": "x"}], "echo": False, "functions": [],
                "function_call": "none", "chat_template": None}
    assert (await client.post("/v1/chat/completions", json=harmless)).status_code == 200


async def test_the_values_of_unimplemented_fields_that_ask_nothing_are_accepted(client):
    response = await client.post("/v1/completions", json={
        "prompt": "x", "use_beam_search": False, "logits_processors": []})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_allowed_token_ids_reach_the_engine_as_a_tuple(client, engine, endpoint):
    prompt = {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    response = await client.post(endpoint, json={**prompt, "allowed_token_ids": [29, 28, 29]})
    assert response.status_code == 200, response.text
    assert engine.added[0].sampling_params.allowed_token_ids == (29, 28)  # a repeat dropped


@pytest.mark.parametrize("value, message", [
    ([], "allowed_token_ids must not be empty"),
    ([5, -1], "allowed_token_ids token ids must be non-negative integers, got -1"),
    ([5, 10**6], "allowed_token_ids token id 1000000 is out of range for a vocabulary of"),
    (list(range(2**18 + 1)), "at most 262144 allowed_token_ids are allowed, got 262145")])
async def test_bad_allowed_token_ids_are_a_400_saying_which_limit(client, engine, value, message):
    response = await client.post("/v1/completions", json={"prompt": "x", "allowed_token_ids": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "allowed_token_ids" and error["message"].startswith(message), error
    assert not engine.added


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_object"}}, {"structured_outputs": {"choice": ["a", "b"]}}])
async def test_allowed_token_ids_travel_beside_structured_output(client, engine, constraint):
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "allowed_token_ids": [28], "bad_words": ["b"],
        **constraint})
    assert response.status_code == 200, response.text
    added = engine.added[0]
    assert added.grammar is not None and added.sampling_params.allowed_token_ids == (28,)
    assert added.sampling_params.bad_words_token_ids


async def test_bad_words_reach_the_engine_tokenized_as_vllm_does(client, engine, tokenizer):
    words = ["Paris", " capital of", "is"]  # "is" and " is" are one token each
    response = await client.post("/v1/completions", json={"prompt": "x", "bad_words": words})
    assert response.status_code == 200, response.text
    expected = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        expected += [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    assert engine.added[0].sampling_params.bad_words_token_ids == tuple(expected)
    assert len(expected) > len(words)  # some word also banned in mid-text form


@pytest.mark.parametrize("value, message", [
    (["ok", "  "], "bad_words must not hold an empty word"),
    (["x" * 200], "each of bad_words must be 1 to 64 tokens long"),
    ([f"w{i}" for i in range(129)], "at most 128 bad_words are allowed, got 129")])
async def test_bad_bad_words_are_a_400_saying_which_limit(client, engine, value, message):
    response = await client.post("/v1/completions", json={"prompt": "x", "bad_words": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("bad_words") and message in error["message"], error
    assert not engine.added


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, engine, config, tokenizer):
    body = (await client.post("/v1/completions", json={"prompt": IDS, "truncate_prompt_tokens": 4,
                                                       "echo": True, "max_tokens": 2})).json()
    assert engine.added[-1].prompt_token_ids == IDS[-4:]
    assert body["usage"]["prompt_tokens"] == 4
    assert body["choices"][0]["text"].startswith(tokenizer.decode(IDS[-4:], skip_special_tokens=False))
    messages = [{"role": "user", "content": "hello there"}]
    await client.post("/v1/chat/completions", json={"messages": messages, "truncate_prompt_tokens": 3})
    assert engine.added[-1].prompt_token_ids == tokenizer.encode_chat(messages)[-3:]


async def test_a_prompt_too_long_for_the_model_fits_once_truncated(client, engine, config):
    too_long = IDS * 5  # 150 tokens, max_model_len 128
    refused = await client.post("/v1/completions", json={"prompt": too_long})
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    text = "word " * 400
    for prompt in (too_long, text):
        response = await client.post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 64})
        assert response.status_code == 200, response.text
        assert len(engine.added[-1].prompt_token_ids) == 64
    for max_tokens, kept in ((None, config.max_model_len - 1), (8, config.max_model_len - 8)):
        response = await client.post("/v1/completions", json={"prompt": too_long, "truncate_prompt_tokens": -1,
                                                               "max_tokens": max_tokens})
        assert response.status_code == 200, response.text
        assert len(engine.added[-1].prompt_token_ids) == kept  # -1: as much as leaves room for the output
    for keep in (0, -2, config.max_model_len):
        response = await client.post("/v1/completions", json={"prompt": IDS, "truncate_prompt_tokens": keep})
        assert response.status_code == 400 and response.json()["error"]["param"] == "truncate_prompt_tokens"


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, engine, sse):
    response = await client.post("/v1/completions", json={
        "prompt": IDS, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events, done = sse(response.text)
    assert done and all(e["usage"]["prompt_tokens"] == len(IDS) for e in events)
    completion_tokens = [e["usage"]["completion_tokens"] for e in events]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 4
    assert events[-1]["choices"] == [] and 0 < completion_tokens[-2] <= 4


async def test_skip_special_tokens_false_keeps_their_text(client, engine, tokenizer):
    engine.reply_token_ids = tokenizer.encode("Hi", add_special_tokens=False) + [1] + tokenizer.encode(
        " there", add_special_tokens=False)  # 1: <|im_start|>, a special token that stops nothing
    texts = {}
    for skip in (True, False):
        body = (await client.post("/v1/completions", json={"prompt": "x", "skip_special_tokens": skip})).json()
        texts[skip] = body["choices"][0]["text"]
    assert "<|im_start|>" in texts[False] and texts[False].replace("<|im_start|>", "") == texts[True]


@pytest.mark.parametrize("spaces", [None, True, False])
async def test_adjacent_special_tokens_are_joined_without_spaces_whatever_spaces_between_special_tokens_says(
        client, engine, tokenizer, spaces):
    """As vLLM's fast-tokenizer detokenizer: the field is accepted and the texts are joined as they are."""
    engine.reply_token_ids = tokenizer.encode("Hi", add_special_tokens=False) + [1, 1]  # <|im_start|> twice
    body = (await client.post("/v1/completions", json={"prompt": "x", "skip_special_tokens": False,
                                                       "spaces_between_special_tokens": spaces})).json()
    assert body["choices"][0]["text"] == "Hi<|im_start|><|im_start|>"


async def test_tokenize_returns_the_token_strings_when_asked(client, tokenizer):
    body = (await client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})).json()
    assert body["token_strs"] == [tokenizer.token_piece(t) for t in body["tokens"]]
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "Hello world"
    assert "token_strs" not in (await client.post("/tokenize", json={"prompt": "Hello"})).json()


async def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(client, engine, tokenizer):
    body = {"prompt": "The capital", "logprobs": 2, "echo": True, "max_tokens": 5}
    plain = (await client.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    named = (await client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}))
    logprobs = named.json()["choices"][0]["logprobs"]
    token_ids = [*engine.added[1].prompt_token_ids, *engine.reply_token_ids[:5]]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in token_ids]
    assert logprobs["text_offset"] == plain["text_offset"]  # offsets into the text, as without it
    assert logprobs["token_logprobs"] == plain["token_logprobs"]
    assert all(key.startswith("token_id:") for top in logprobs["top_logprobs"][1:] for key in top)


async def test_streamed_chat_logprobs_name_tokens_by_id_and_keep_their_bytes(client, engine, tokenizer, sse):
    response = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2, "stream": True,
        "max_tokens": 6, "return_tokens_as_token_ids": True})
    events, _ = sse(response.text)
    content = [item for event in events for choice in event["choices"] if choice.get("logprobs")
               for item in choice["logprobs"]["content"]]
    assert [item["token"] for item in content] == [f"token_id:{t}" for t in engine.reply_token_ids[:6]]
    assert [bytes(item["bytes"]) for item in content] == [tokenizer.token_bytes(t) for t in engine.reply_token_ids[:6]]
    assert all(top["token"].startswith("token_id:") for item in content for top in item["top_logprobs"])
