"""On the real default model, a worker SIGKILLed in the middle of a 64-request burst is replaced and
all 64 requests finish with the greedy text of an undisturbed run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from support import free_port, metric_value, supervised

from deploy.launcher import Stack
from deploy.model_info import read_model_info
from deploy.model_source import default_model_dir
from proto.config import EngineConfig

NUM_REQUESTS = 64
MAX_TOKENS = 16
SUBJECTS = ["lighthouses", "bees", "volcanoes", "trains", "libraries", "rivers", "comets", "bridges"]
PROMPTS = [f"Request {i}. Write one sentence about {SUBJECTS[i % len(SUBJECTS)]}." for i in range(NUM_REQUESTS)]


def default_config() -> EngineConfig:
    """fp32 on every CPU: the same text after recovery is promised where a token's numerics do not
    depend on how its KV was computed (docs/reliability.md, "Which text after a recovery")."""
    model_dir = default_model_dir()
    info = read_model_info(model_dir)
    return EngineConfig(model=str(model_dir), served_model_name="smollm2", dtype="float32", vocab_size=info.vocab_size,
                        eos_token_ids=info.eos_token_ids, max_model_len=2048, port=free_port(),
                        kv_cache_memory_bytes=256 << 20, log_level="warning", step_timeout_s=30.0)


def run_burst(url: str) -> list[tuple[str, str]]:
    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"], choice["finish_reason"]

    async def burst() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            return await asyncio.gather(*(one(client, prompt) for prompt in PROMPTS))
    return asyncio.run(burst())


@pytest.mark.slow
def test_a_worker_killed_mid_burst_loses_none_of_64_requests_on_the_default_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Stack(default_config()) as stack:
        undisturbed = run_burst(stack.url)
    # Step 6: the burst's prompts are prefilled, and every request is a few tokens into its output.
    monkeypatch.setenv("CONVEYOR_FAULT_INJECTION", f"rank=0,step=6,action=kill,once={tmp_path / 'fired'}")
    with Stack(default_config()) as stack, supervised(stack):
        recovered = run_burst(stack.url)
        assert (tmp_path / "fired").exists()
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="worker") == 1
        assert metric_value(stack.url, "conveyor:requests_recovered_total") >= 1
    assert len(recovered) == NUM_REQUESTS
    assert recovered == undisturbed
