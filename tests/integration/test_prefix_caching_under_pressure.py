"""Prefix caching with the real model: concurrent requests sharing a long prefix on a KV cache small
enough to preempt and evict give exactly the greedy text of a run with caching off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from support import metric_value, tiny_config

from deploy.launcher import Stack

SHARED = [(13 * i + 7) % 400 + 20 for i in range(70)]  # 4 full blocks of 16 and a partial one
PROMPTS = [SHARED + [(31 * i + j) % 400 + 20 for j in range(3 + i % 5)] for i in range(10)]
MAX_TOKENS = 30


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


def test_shared_prefix_requests_under_kv_pressure_match_a_run_without_caching(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    texts, cached_tokens = {}, {}
    for caching in (True, False):
        # 16 blocks of 16: each request needs up to 7 (4 of them shared with caching on); eight
        # seats cannot all fit, so some are preempted and cached blocks evicted while shared.
        config = tiny_config(tiny_model_dir, enable_prefix_caching=caching, num_kv_blocks=16,
                             max_num_seqs=8, max_num_batched_tokens=64)
        with Stack(config, log_dir=tmp_path / f"caching-{caching}") as stack:
            results = asyncio.run(_completions(stack.url))
            texts[caching] = [text for text, _ in results]
            cached_tokens[caching] = [cached for _, cached in results]
            if caching:
                assert metric_value(stack.url, "conveyor:prefix_cache_hits_total") >= 64
                assert metric_value(stack.url, "conveyor:num_preemptions_total") > 0
    assert texts[True] == texts[False]
    assert cached_tokens[False] == [0] * len(PROMPTS)
    assert cached_tokens[True][0] == 0 and max(cached_tokens[True][1:]) >= 64
