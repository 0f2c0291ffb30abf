"""n > 1, logprobs (against Hugging Face fp32) and prefix-cache hits through the real stack."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support import sse_events

from deploy.launcher import Stack
from frontend.tokenizer import Tokenizer

PROMPT_IDS = [11, 87, 203, 45, 310, 77, 5, 129, 64, 402, 18, 255]
NUM_NEW = 6
TOP_K = 3


def post(stack: Stack, path: str, body: dict) -> dict:
    response = httpx.post(f"{stack.url}{path}", json={"model": "tiny", **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def hf_greedy_logprobs(model_dir: Path, prompt_ids: list[int], num_new: int) -> tuple[list[int], list]:
    """Greedy token ids after `prompt_ids` and log_softmax of HF's fp32 logits at every position
    (row t predicts token t + 1), without stopping at EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(num_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
        logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), dim=-1)
    return ids[len(prompt_ids):], logprobs


def test_greedy_choices_are_identical(stack: Stack) -> None:
    body = post(stack, "/v1/completions", {"prompt": "The quick brown fox", "n": 2, "max_tokens": 12,
                                           "temperature": 0, "ignore_eos": True})
    texts = [choice["text"] for choice in body["choices"]]
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert texts[0] == texts[1] and texts[0]
    assert body["usage"]["completion_tokens"] == 24


def test_seeded_choices_are_reproducible_and_differ_from_each_other(stack: Stack) -> None:
    request = {"prompt": "Once upon a time", "n": 4, "max_tokens": 16, "temperature": 1.0,
               "seed": 1234, "ignore_eos": True}
    first = [c["text"] for c in post(stack, "/v1/completions", request)["choices"]]
    second = [c["text"] for c in post(stack, "/v1/completions", request)["choices"]]
    assert first == second
    assert len(set(first)) > 1, "every choice sampled the same tokens: per-choice seeds missing"


def test_streamed_choices_carry_their_index_and_match_the_unstreamed_ones(stack: Stack) -> None:
    request = {"prompt": "Paged attention", "n": 2, "max_tokens": 10, "temperature": 0,
               "ignore_eos": True}
    expected = [c["text"] for c in post(stack, "/v1/completions", request)["choices"]]
    with httpx.stream("POST", f"{stack.url}/v1/completions", timeout=120,
                      json={"model": "tiny", **request, "stream": True}) as response:
        events = sse_events(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    texts, finishes = ["", ""], [[], []]
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]].append(choice["finish_reason"])
    assert texts == expected and finishes == [["length"], ["length"]]


def test_logprobs_of_greedy_tokens_equal_hf_log_softmax(stack: Stack, tiny_model_dir: Path) -> None:
    generated, hf = hf_greedy_logprobs(tiny_model_dir, PROMPT_IDS, NUM_NEW)
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    request = {"prompt": PROMPT_IDS, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
               "logprobs": TOP_K, "echo": True}
    for _ in range(2):  # the second time the prompt is in the prefix cache: still every position
        logprobs = post(stack, "/v1/completions", request)["choices"][0]["logprobs"]
        num_prompt = len(PROMPT_IDS)
        assert logprobs["tokens"] == [tokenizer.token_text(t) for t in PROMPT_IDS + generated]
        assert logprobs["token_logprobs"][0] is None
        expected = [float(hf[t, token]) for t, token in enumerate((PROMPT_IDS + generated)[1:])]
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
        for step in range(NUM_NEW):
            row = num_prompt - 1 + step
            top = sorted(logprobs["top_logprobs"][num_prompt + step].values(), reverse=True)
            assert top[:TOP_K] == pytest.approx(hf[row].topk(TOP_K).values.tolist(), abs=1e-4)


def test_chat_logprobs_list_every_generated_token(stack: Stack) -> None:
    body = post(stack, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2})
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 5
    for item in content:
        assert item["logprob"] <= 0 and len(item["top_logprobs"]) == 2
        assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"], abs=1e-5)  # greedy
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]


def test_repeated_long_prompt_reports_cached_tokens(stack: Stack) -> None:
    prompt = [(7 * i + 3) % 500 + 5 for i in range(80)]  # 5 full blocks of 16
    request = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = post(stack, "/v1/completions", request)["usage"]
    second = post(stack, "/v1/completions", request)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < second["prompt_tokens_details"]["cached_tokens"] < len(prompt)
