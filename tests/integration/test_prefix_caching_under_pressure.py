"""The real model on a KV cache small enough to preempt: with prefix caching off every request still
gets HF's greedy text, and concurrent requests sharing a long prefix with caching on (preempting and
evicting while shared) give exactly the text of the run with caching off."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support import hf_greedy_logprobs, metric_value, tiny_config

from deploy.launcher import Stack

SHARED = [(13 * i + 7) % 400 + 20 for i in range(70)]  # 4 full blocks of 16 and a partial one
PROMPTS = [SHARED + [(31 * i + j) % 400 + 20 for j in range(3 + i % 5)] for i in range(10)]
MAX_TOKENS = 30


@dataclass(frozen=True)
class PressuredRun:
    texts: list[str]
    cached_tokens: list[int]
    num_preemptions: float
    prefix_cache_hits: float


async def _completions(base_url: str) -> list[tuple[list[int] | str, int]]:
    async def one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[str, int]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        payload = response.json()
        cached = (payload["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return payload["choices"][0]["text"], cached

    async with httpx.AsyncClient(base_url=base_url, timeout=180) as client:
        first = await one(client, PROMPTS[0])  # warms the cache with the shared prefix
        return [first] + list(await asyncio.gather(*(one(client, p) for p in PROMPTS[1:])))


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, PressuredRun]:
    """The same requests with prefix caching on and off, by `enable_prefix_caching`."""
    found = {}
    for caching in (True, False):
        # 16 blocks of 16: each request needs up to 7 (4 of them shared with caching on); eight
        # seats cannot all fit, so some are preempted (and cached blocks evicted while shared).
        config = tiny_config(tiny_model_dir, enable_prefix_caching=caching, num_kv_blocks=16,
                             max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
        with Stack(config, log_dir=tmp_path_factory.mktemp(f"caching-{caching}")) as stack:
            results = asyncio.run(_completions(stack.url))
            found[caching] = PressuredRun(
                texts=[text for text, _ in results], cached_tokens=[cached for _, cached in results],
                num_preemptions=metric_value(stack.url, "conveyor:num_preemptions_total"),
                prefix_cache_hits=metric_value(stack.url, "conveyor:prefix_cache_hits_total"))
    return found


def test_preempted_requests_without_prefix_caching_give_the_hf_greedy_text(
        runs: dict[bool, PressuredRun], tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = [tokenizer.decode(hf_greedy_logprobs(tiny_model_dir, prompt, MAX_TOKENS)[0],
                                 skip_special_tokens=True) for prompt in PROMPTS]
    uncached = runs[False]
    assert uncached.num_preemptions > 0
    assert uncached.cached_tokens == [0] * len(PROMPTS)
    assert uncached.texts == expected


def test_shared_prefix_requests_under_kv_pressure_match_a_run_without_caching(
        runs: dict[bool, PressuredRun]) -> None:
    cached = runs[True]
    assert cached.prefix_cache_hits >= 64 and cached.num_preemptions > 0
    assert cached.texts == runs[False].texts
    assert cached.cached_tokens[0] == 0 and max(cached.cached_tokens[1:]) >= 64
