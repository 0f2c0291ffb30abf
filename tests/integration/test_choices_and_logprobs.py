"""n > 1, logprobs (against Hugging Face fp32) and prefix-cache hits through the real stack."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from support import hf_greedy_logprobs, metric_value, sse_events

from deploy.launcher import Stack
from frontend.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

PROMPT_IDS = [(37 * i + 11) % 440 + 5 for i in range(40)]  # 2 full KV blocks of 16 and a partial one
NUM_NEW = 6
TOP_K = 3


def post(stack: Stack, path: str, body: dict) -> dict:
    response = httpx.post(f"{stack.url}{path}", json={"model": "tiny", **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


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


def early_stop_string(text: str, sibling: str) -> str:
    """A printable piece of the first quarter of `text`, not earlier in it and nowhere in `sibling`."""
    for start in range(1, len(text) // 4):
        for size in (4, 6, 8):
            piece = text[start:start + size]
            readable = piece.isascii() and piece.isprintable()
            if readable and text.index(piece) == start and piece not in sibling:
                return piece
    pytest.fail(f"no early stop string in {text!r} that {sibling!r} lacks")


def test_a_choice_stopped_early_by_a_stop_string_stops_computing_while_its_sibling_runs_on(
        stack: Stack) -> None:
    max_tokens = 128
    request = {"prompt": "Once upon a time", "n": 2, "max_tokens": max_tokens, "temperature": 1.0,
               "seed": 4321, "ignore_eos": True}
    iteration_tokens = "conveyor:iteration_tokens_total_sum"  # tokens the workers computed
    post(stack, "/v1/completions", request)  # puts the prompt in the prefix cache for both runs below
    before = metric_value(stack.url, iteration_tokens)
    full = [c["text"] for c in post(stack, "/v1/completions", request)["choices"]]
    full_cost = metric_value(stack.url, iteration_tokens) - before
    stop = early_stop_string(full[0], full[1])
    before = metric_value(stack.url, iteration_tokens)
    choices = post(stack, "/v1/completions", {**request, "stop": stop})["choices"]
    cost = metric_value(stack.url, iteration_tokens) - before
    assert (choices[0]["text"], choices[0]["finish_reason"]) == (full[0][:full[0].index(stop)], "stop")
    assert (choices[1]["text"], choices[1]["finish_reason"]) == (full[1], "length")
    # choice 0 met its stop string within about its first quarter; without a per-choice abort it
    # would have run all max_tokens alongside its sibling (the slack covers the abort's latency)
    assert cost <= full_cost - max_tokens // 4, f"{cost} tokens computed with the stop, {full_cost} without"
    assert metric_value(stack.url, "conveyor:kv_cache_usage_perc") == 0


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir: Path) -> tuple[list[int], torch.Tensor]:
    return hf_greedy_logprobs(tiny_model_dir, PROMPT_IDS, NUM_NEW)


def assert_top_logprobs_equal_hf(top_logprobs: list[dict[str, float]], generated: list[int],
                                 hf: torch.Tensor, tokenizer: Tokenizer) -> None:
    """`top_logprobs[step]` is the legacy entry after PROMPT_IDS + step generated tokens: HF's
    TOP_K best keyed by text (of two tokens with one text the lower-ranked wins, as in a dict
    built in rank order) plus the generated token itself."""
    for step, token_id in enumerate(generated):
        row = hf[len(PROMPT_IDS) - 1 + step]
        values, ids = row.topk(TOP_K)
        expected = {tokenizer.token_text(int(i)): float(v) for v, i in zip(values, ids)}
        expected.setdefault(tokenizer.token_text(token_id), float(row[token_id]))
        assert top_logprobs[step] == pytest.approx(expected, abs=1e-4)


def test_echoed_prompt_and_greedy_tokens_have_hf_logprobs_at_every_position(
        stack: Stack, tiny_model_dir: Path, hf_reference: tuple[list[int], torch.Tensor]) -> None:
    generated, hf = hf_reference
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    request = {"prompt": PROMPT_IDS, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
               "logprobs": TOP_K, "echo": True}
    for _ in range(2):  # the second time the prompt's blocks are cached: still every position
        logprobs = post(stack, "/v1/completions", request)["choices"][0]["logprobs"]
        assert logprobs["tokens"] == [tokenizer.token_text(t) for t in PROMPT_IDS + generated]
        assert logprobs["token_logprobs"][0] is None
        expected = [float(hf[t, token]) for t, token in enumerate((PROMPT_IDS + generated)[1:])]
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
        assert_top_logprobs_equal_hf(logprobs["top_logprobs"][len(PROMPT_IDS):], generated, hf, tokenizer)


def test_a_prompt_scored_with_echo_and_max_tokens_0_has_hf_logprobs_and_nothing_generated(
        stack: Stack, tiny_model_dir: Path, hf_reference: tuple[list[int], torch.Tensor]) -> None:
    _, hf = hf_reference
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    body = post(stack, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 0, "echo": True, "logprobs": TOP_K})
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode(PROMPT_IDS, skip_special_tokens=False)
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.token_text(t) for t in PROMPT_IDS]
    expected = [float(hf[t, token]) for t, token in enumerate(PROMPT_IDS[1:])]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)


def test_prompt_logprobs_have_hf_logprobs_and_ranks_even_after_a_prefix_cache_hit(
        stack: Stack, tiny_model_dir: Path, hf_reference: tuple[list[int], torch.Tensor]) -> None:
    """vLLM's shape: null, then per prompt token {id: {logprob, rank, decoded_token}} for the token
    and HF's TOP_K best (ranks 1..TOP_K); the second request finds the prompt's blocks cached."""
    _, hf = hf_reference
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    for _ in range(2):
        body = post(stack, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": TOP_K})
        shape = body["choices"][0]["prompt_logprobs"]
        assert len(shape) == len(PROMPT_IDS) and shape[0] is None
        for position in range(1, len(PROMPT_IDS)):
            row, token = hf[position - 1], PROMPT_IDS[position]
            tokens = shape[position]
            assert list(tokens)[0] == str(token)
            entry = tokens[str(token)]
            assert entry["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
            value = float(row[token])  # the rank counts the tokens at least as likely (a near-tie either way)
            assert int((row >= value + 1e-4).sum()) <= entry["rank"] <= int((row >= value - 1e-4).sum())
            assert entry["decoded_token"] == tokenizer.token_text(token)
            values, ids = row.topk(TOP_K)
            for rank, (value, top_id) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
                assert tokens[str(top_id)]["logprob"] == pytest.approx(value, abs=1e-4)
                assert tokens[str(top_id)]["rank"] == rank


def test_greedy_logprobs_after_a_prefix_cache_hit_equal_hf_log_softmax(
        stack: Stack, tiny_model_dir: Path, hf_reference: tuple[list[int], torch.Tensor]) -> None:
    generated, hf = hf_reference
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    request = {"prompt": PROMPT_IDS, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True,
               "logprobs": TOP_K}  # no echo: no prompt logprobs owed, so the prompt may come from the cache
    post(stack, "/v1/completions", request)  # publishes the prompt's full blocks
    body = post(stack, "/v1/completions", request)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # both full blocks
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [tokenizer.token_text(t) for t in generated]
    expected = [float(hf[len(PROMPT_IDS) - 1 + step, token]) for step, token in enumerate(generated)]
    assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert_top_logprobs_equal_hf(logprobs["top_logprobs"], generated, hf, tokenizer)


def test_repeated_long_prompt_reports_cached_tokens(stack: Stack) -> None:
    prompt = [(7 * i + 3) % 500 + 5 for i in range(80)]  # 5 full blocks of 16
    request = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = post(stack, "/v1/completions", request)["usage"]
    second = post(stack, "/v1/completions", request)["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < second["prompt_tokens_details"]["cached_tokens"] < len(prompt)


def test_a_batch_of_prompts_gives_each_prompt_the_text_it_gets_alone(stack: Stack) -> None:
    prompts = [[11, 12, 13, 14], [40, 41], [7, 8, 9]]
    request = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}
    alone = [post(stack, "/v1/completions", {**request, "prompt": p})["choices"][0]["text"] for p in prompts]
    body = post(stack, "/v1/completions", {**request, "prompt": prompts})
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [text for text in alone for _ in range(2)]
    assert body["usage"]["prompt_tokens"] == 9 and body["usage"]["completion_tokens"] == 36
