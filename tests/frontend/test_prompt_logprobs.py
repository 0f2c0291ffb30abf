"""vLLM's prompt_logprobs on completions (per choice) and chat (beside the choices), with a fake engine
whose entries are known (frontend_fakes: each prompt token is its own best, then made-up runners-up)."""

from __future__ import annotations

import pytest
from frontend_fakes import prompt_logprob

from frontend.engine_outputs import TokenLogprob
from frontend.logprobs import vllm_prompt_logprobs

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "hi"}]


def expected_shape(prompt_ids: list[int], k: int, tokenizer) -> list[dict | None]:
    """What the fake engine's entries give: the token (rank 1) and its k - 1 made-up runners-up."""
    shape: list[dict | None] = [None]
    for position in range(1, len(prompt_ids)):
        token, logprob = prompt_ids[position], prompt_logprob(position)
        tokens = {str(token): {"logprob": logprob, "rank": 1, "decoded_token": tokenizer.token_text(token)}}
        for i in range(1, k):
            tokens[str(token + i)] = {"logprob": logprob - i, "rank": i + 1,
                                      "decoded_token": tokenizer.token_text(token + i)}
        shape.append(tokens)
    return shape


def rounded(shape: list[dict | None]) -> list[dict | None]:
    """logprobs to 5 places, so that shapes compare with == (pytest.approx takes no nested dicts)."""
    return [None if tokens is None else {key: {**entry, "logprob": round(entry["logprob"], 5)}
                                         for key, entry in tokens.items()} for tokens in shape]


async def test_completions_carry_prompt_logprobs_on_every_choice(client, engine, tokenizer):
    response = await client.post("/v1/completions", json={"prompt": "The capital of", "prompt_logprobs": 3,
                                                           "max_tokens": 2, "n": 2})
    assert response.status_code == 200, response.text
    added = engine.added[0]
    assert added.sampling_params.prompt_logprobs == 3 and added.sampling_params.logprobs == -1
    prompt_ids = list(added.prompt_token_ids)
    choices = response.json()["choices"]
    for choice in choices:
        assert rounded(choice["prompt_logprobs"]) == rounded(expected_shape(prompt_ids, 3, tokenizer))
        assert choice["logprobs"] is None
    assert list(choices[0]["prompt_logprobs"][1]) == [str(prompt_ids[1]), str(prompt_ids[1] + 1),
                                                      str(prompt_ids[1] + 2)]  # the token first, then by rank


async def test_prompt_logprobs_0_gives_each_prompt_token_alone(client, engine, tokenizer):
    response = await client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "prompt_logprobs": 0,
                                                           "max_tokens": 1})
    shape = response.json()["choices"][0]["prompt_logprobs"]
    assert rounded(shape) == rounded(expected_shape([5, 6, 7, 8], 1, tokenizer))


async def test_echo_logprobs_and_prompt_logprobs_each_show_their_own_number(client, engine, tokenizer):
    """The engine computes the larger of the two; echo's top_logprobs still show logprobs' k."""
    response = await client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "echo": True, "logprobs": 1,
                                                           "prompt_logprobs": 4, "max_tokens": 2})
    assert engine.added[0].sampling_params.prompt_logprobs == 4
    choice = response.json()["choices"][0]
    assert rounded(choice["prompt_logprobs"]) == rounded(expected_shape([5, 6, 7, 8], 4, tokenizer))
    assert [top and len(top) for top in choice["logprobs"]["top_logprobs"][:4]] == [None, 1, 1, 1]


async def test_chat_puts_prompt_logprobs_beside_the_choices(client, engine, tokenizer):
    response = await client.post("/v1/chat/completions", json={"messages": USER, "prompt_logprobs": 2,
                                                                "max_tokens": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    prompt_ids = list(engine.added[0].prompt_token_ids)
    assert engine.added[0].sampling_params.prompt_logprobs == 2
    assert rounded(body["prompt_logprobs"]) == rounded(expected_shape(prompt_ids, 2, tokenizer))
    assert "prompt_logprobs" not in body["choices"][0] and body["choices"][0]["logprobs"] is None


async def test_echo_with_logprobs_also_fills_prompt_logprobs_with_its_top_k_as_vllm_does(client, engine, tokenizer):
    response = await client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "echo": True, "logprobs": 2,
                                                           "max_tokens": 1})
    shape = response.json()["choices"][0]["prompt_logprobs"]
    assert rounded(shape) == rounded(expected_shape([5, 6, 7, 8], 2, tokenizer))


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_without_prompt_logprobs_no_entries_are_asked_and_the_field_is_null(client, engine, endpoint):
    prompt = {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": USER}
    body = (await client.post(endpoint, json={**prompt, "max_tokens": 1})).json()
    assert engine.added[0].sampling_params.prompt_logprobs == -1
    if endpoint == "/v1/completions":
        assert body["choices"][0]["prompt_logprobs"] is None and "prompt_logprobs" not in body
    else:
        assert body["prompt_logprobs"] is None and "prompt_logprobs" not in body["choices"][0]


def test_a_token_outside_its_top_comes_first_with_its_rank_and_one_inside_takes_its_top_rank(tokenizer):
    """vLLM's dict: the token first, then the top k by rank; a token among them takes their entry."""
    outside = TokenLogprob(1, 50, -3.0, ((60, -0.5), (61, -1.0)), rank=7)
    inside = TokenLogprob(2, 61, -1.0, ((60, -0.5), (61, -1.0)), rank=2)
    shape = vllm_prompt_logprobs(tokenizer, [40, 50, 61], {1: outside, 2: inside}, 2)
    assert shape[0] is None
    assert [(key, entry["rank"], entry["logprob"]) for key, entry in shape[1].items()] == [
        ("50", 7, -3.0), ("60", 1, -0.5), ("61", 2, -1.0)]
    assert [(key, entry["rank"]) for key, entry in shape[2].items()] == [("61", 2), ("60", 1)]
    assert shape[1]["50"]["decoded_token"] == tokenizer.token_text(50)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, message", [
    ({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20, got 21"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be between 0 and 20, got -1"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs is not available with stream: true")])
async def test_bad_prompt_logprobs_are_a_400_naming_the_field(client, engine, endpoint, extra, message):
    prompt = {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": USER}
    response = await client.post(endpoint, json={**prompt, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt_logprobs" and message in error["message"]
    assert not engine.added


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stream_takes_prompt_logprobs_0_as_vllm_does_and_sends_none(client, engine, endpoint, sse):
    prompt = {"prompt": "x"} if endpoint == "/v1/completions" else {"messages": USER}
    response = await client.post(endpoint, json={**prompt, "prompt_logprobs": 0, "stream": True, "max_tokens": 2})
    assert response.status_code == 200, response.text
    events, done = sse(response.text)
    assert done and events
    assert engine.added[0].sampling_params.prompt_logprobs == -1  # nothing computed for a field never sent
    assert not any("prompt_logprobs" in event or any("prompt_logprobs" in choice for choice in event["choices"])
                   for event in events)
