"""The whole stack over HTTP: HF parity, concurrency, disconnects, static vs continuous."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from support import hf_greedy_texts, metric_value, sse_events, tiny_config

from deploy.cpu_isa import cpu_isa, rank, read_cpu_flags
from deploy.launcher import Stack
from proto.config import CPU_ISAS

PROMPTS = [f"Request {i}: the quick brown fox" + " jumps over" * (i % 7) for i in range(32)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_texts(tiny_model_dir: Path) -> list[str]:
    return hf_greedy_texts(tiny_model_dir, PROMPTS, MAX_TOKENS)


async def _stream_text(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events([line async for line in response.aiter_lines()])
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    return text, chunks[-1]["choices"][0]["finish_reason"]


async def _all_streams(base_url: str) -> list[tuple[str, str]]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return await asyncio.gather(*(_stream_text(client, p) for p in PROMPTS))


def test_greedy_completion_over_http_equals_hf_generate(stack: Stack, hf_texts: list[str]) -> None:
    for prompt, expected in list(zip(PROMPTS, hf_texts))[:4]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == expected
        assert choice["finish_reason"] in ("stop", "length")


def test_32_concurrent_streams_all_complete_with_hf_text(stack: Stack, hf_texts: list[str]) -> None:
    results = asyncio.run(_all_streams(stack.url))
    assert [text for text, _ in results] == hf_texts
    assert all(reason in ("stop", "length") for _, reason in results)


def test_static_and_continuous_scheduling_give_identical_greedy_outputs(
        tiny_model_dir: Path, hf_texts: list[str], tmp_path: Path) -> None:
    config = tiny_config(tiny_model_dir, scheduling="static")
    with Stack(config, log_dir=tmp_path) as static_stack:
        results = asyncio.run(_all_streams(static_stack.url))
    assert [text for text, _ in results] == hf_texts


def test_hung_up_client_is_aborted_and_its_blocks_freed(stack: Stack) -> None:
    computed = "conveyor:iteration_tokens_total_sum"  # what the workers computed, from scheduler stats
    max_tokens, prompt = 480, "Abandon me"
    num_prompt = httpx.post(f"{stack.url}/tokenize", json={"prompt": prompt}, timeout=10).json()["count"]
    before = metric_value(stack.url, computed)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # leaving the blocks hangs up after the first chunk
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (metric_value(stack.url, "conveyor:num_requests_running") == 0
                and metric_value(stack.url, "conveyor:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.2)
    assert metric_value(stack.url, "conveyor:num_requests_running") == 0
    assert metric_value(stack.url, "conveyor:kv_cache_usage_perc") == 0
    # Run to the end, the request costs num_prompt + max_tokens - 1 tokens; aborted, a few steps.
    num_computed = metric_value(stack.url, computed) - before
    assert num_computed < num_prompt + max_tokens // 2, \
        f"the scheduler computed {num_computed} tokens for the abandoned request: it was not aborted"


def test_health_models_and_version_answer(stack: Stack) -> None:
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200
    models = httpx.get(f"{stack.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert httpx.get(f"{stack.url}/version", timeout=10).status_code == 200


ISA_CAPS = [level for level in CPU_ISAS if rank(level) <= rank(cpu_isa(read_cpu_flags()).detected)]


@pytest.mark.cpu_workers
@pytest.mark.parametrize("cap", ISA_CAPS)
@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16"])
def test_a_stack_serves_under_every_isa_cap_this_cpu_allows(
        tiny_model_dir: Path, hf_texts: list[str], cap: str, dtype: str) -> None:
    """Held to a lower ISA (the dtype choice, the kernel's compile flags, torch's oneDNN and ATen),
    the stack still starts and serves; auto without native bf16 is fp32 with a bf16 KV cache
    (from AVX2 up), and an explicit float32 still equals HF exactly."""
    config = tiny_config(tiny_model_dir, cpu_isa=cap, dtype=dtype)
    with Stack(config) as capped:
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(f"{capped.url}/v1/completions", json=body, timeout=60)
        version = httpx.get(f"{capped.url}/version", timeout=10).json()
    assert response.status_code == 200, response.text
    assert version["dtype"] == capped.config.dtype != "auto"
    assert version["kv_cache_dtype"] == capped.config.kv_cache_dtype != "auto"
    if dtype == "auto" and version["dtype"] == "float32":
        assert version["kv_cache_dtype"] == ("float32" if cap == "baseline" else "bfloat16")
    if dtype == "float32":
        assert version["kv_cache_dtype"] == "float32"
        assert response.json()["choices"][0]["text"] == hf_texts[1]
