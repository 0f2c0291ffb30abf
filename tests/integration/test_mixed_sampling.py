"""Requests with different sampling params in one batch each get their solo run's text; greedy ones HF's."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import hf_greedy_logprobs, metric_value, tiny_config

from deploy.launcher import Stack

MAX_TOKENS = 32  # long enough that every request still runs when the last one arrives
# (prompt, params): one request each; every one but the stop-string one runs all MAX_TOKENS.
SAMPLED = [
    ("Once upon a time", {"temperature": 0.8, "seed": 7}),
    ("Continuous batching admits", {"temperature": 1.0, "top_k": 5, "seed": 11}),
    ("Paged attention stores keys", {"temperature": 1.0, "top_p": 0.8, "seed": 13}),
    ("Héllo wörld", {"temperature": 1.0, "min_p": 0.1, "seed": 17}),
    ("The lazy dog", {"temperature": 0, "presence_penalty": 0.8, "frequency_penalty": 0.5,
                      "repetition_penalty": 1.3}),
]
GREEDY_PROMPTS = ["The quick brown fox", "What is the capital of France?"]
STOP_PROMPT = "Emoji and accents"
FORCED_PROMPT, FORCED_WORD = "Paris is", " fox"  # logit_bias +100 on the word's one token
# allowed_token_ids: the one-token words it may sample from, with temperature and a seed, and
# bad_words banning the last one (as written and, being one token either way, in mid-text form)
ALLOWED_PROMPT, ALLOWED_WORDS, BAD_WORD = "Pick one:", (" fox", " dog", " is"), "is"
NUM_REQUESTS = len(SAMPLED) + len(GREEDY_PROMPTS) + 3


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """As many seats as the mix has requests: a step at full occupancy ran every one of them."""
    config = tiny_config(tiny_model_dir, max_num_seqs=NUM_REQUESTS)
    with Stack(config, log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture(scope="module")
def hf_texts(tiny_model_dir: Path) -> dict[str, str]:
    """HF greedy continuations (EOS does not stop them), decoded, by prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = {}
    for prompt in [*GREEDY_PROMPTS, STOP_PROMPT]:
        generated, _ = hf_greedy_logprobs(tiny_model_dir, tokenizer(prompt).input_ids, MAX_TOKENS)
        texts[prompt] = tokenizer.decode(generated, skip_special_tokens=True)
    return texts


def one_token_id(tiny_model_dir: Path, word: str) -> int:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(word).input_ids
    assert len(ids) == 1, ids
    return ids[0]


@pytest.fixture(scope="module")
def forced_token_id(tiny_model_dir: Path) -> int:
    return one_token_id(tiny_model_dir, FORCED_WORD)


@pytest.fixture(scope="module")
def allowed_token_ids(tiny_model_dir: Path) -> list[int]:
    return [one_token_id(tiny_model_dir, word) for word in ALLOWED_WORDS]


def stop_string(text: str) -> str:
    """A printable piece of the second half of `text` that does not occur earlier in it."""
    for start in range(len(text) // 2, len(text) - 4):
        piece = text[start:start + 4]
        if piece.isascii() and piece.isprintable() and text.index(piece) == start:
            return piece
    pytest.fail(f"no stop string in {text!r}")


def mixed_bodies(hf_texts: dict[str, str], forced_token_id: int, allowed_token_ids: list[int]) -> list[dict]:
    base = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    bodies = [{**base, "prompt": prompt, **params} for prompt, params in SAMPLED]
    bodies += [{**base, "prompt": prompt, "temperature": 0} for prompt in GREEDY_PROMPTS]
    bodies.append({**base, "prompt": STOP_PROMPT, "temperature": 0,
                   "stop": [stop_string(hf_texts[STOP_PROMPT])]})
    bodies.append({**base, "prompt": FORCED_PROMPT, "temperature": 0,
                   "logit_bias": {str(forced_token_id): 100}})
    bodies.append({**base, "prompt": ALLOWED_PROMPT, "temperature": 1.0, "seed": 5,
                   "allowed_token_ids": allowed_token_ids, "bad_words": [BAD_WORD]})
    return bodies


async def complete_together(base_url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))
    assert all(response.status_code == 200 for response in responses), [r.text for r in responses]
    return [response.json()["choices"][0] for response in responses]


def full_steps(base_url: str) -> float:
    """Steps that ran with every seat taken (batch_occupancy above the 0.9 bucket)."""
    return (metric_value(base_url, "conveyor:batch_occupancy_count")
            - metric_value(base_url, "conveyor:batch_occupancy_bucket", le="0.9"))


def test_mixed_sampling_params_in_one_batch_each_give_their_solo_text_and_greedy_gives_hf(
        stack: Stack, hf_texts: dict[str, str], forced_token_id: int, allowed_token_ids: list[int]) -> None:
    bodies = mixed_bodies(hf_texts, forced_token_id, allowed_token_ids)
    assert len(bodies) == NUM_REQUESTS
    solo = []
    for body in bodies:
        response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        solo.append(response.json()["choices"][0])
    before = full_steps(stack.url)
    together = asyncio.run(complete_together(stack.url, bodies))
    assert full_steps(stack.url) > before, "the requests never ran in one step together"
    for body, alone, batched in zip(bodies, solo, together):
        assert (batched["text"], batched["finish_reason"]) == (alone["text"], alone["finish_reason"]), body

    *_, greedy_a, greedy_b, stopped, forced, allowed = together
    assert [greedy_a["text"], greedy_b["text"]] == [hf_texts[p] for p in GREEDY_PROMPTS]
    stop = bodies[-3]["stop"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == hf_texts[STOP_PROMPT][:hf_texts[STOP_PROMPT].index(stop)]
    assert forced["text"] == FORCED_WORD * MAX_TOKENS
    words = re.findall("|".join(ALLOWED_WORDS), allowed["text"])
    assert "".join(words) == allowed["text"] and len(words) == MAX_TOKENS
    assert set(words) == set(ALLOWED_WORDS) - {" " + BAD_WORD}
