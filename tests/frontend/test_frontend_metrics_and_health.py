"""/metrics exposes token counts, latencies and scheduler gauges; /health follows heartbeats."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.app import create_app
from frontend.engine_client import ZmqEngineClient
from proto import codec
from proto.messages import StepOutputs

pytestmark = pytest.mark.anyio


def heartbeat(num_running: int = 0, num_waiting: int = 0, kv_cache_usage: float = 0.0) -> bytes:
    return codec.encode(StepOutputs(
        step_id=-1, request_ids=[], cu_new_tokens=np.zeros(1, np.int32),
        new_token_ids=np.zeros(0, np.int32), finish_reasons=[], error_messages=[],
        num_running=num_running, num_waiting=num_waiting, kv_cache_usage=kv_cache_usage,
        num_preemptions_total=0, step_duration_s=0.0, wall_time_s=123.0))


def samples(text: str) -> dict[str, float]:
    """{sample name: value} of the model `tiny`, so the tests read like the exposition."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") == "tiny" and "le" not in sample.labels:
                found[sample.name] = sample.value
    return found


async def test_metrics_count_tokens_and_requests_and_copy_scheduler_gauges(client, engine):
    for max_tokens in (3, 5):
        await client.post("/v1/completions", json={"prompt": "The capital", "max_tokens": max_tokens})
    response = await client.get("/metrics")
    assert response.status_code == 200
    values = samples(response.text)
    num_prompt = sum(len(added.prompt_token_ids) for added in engine.added)
    assert values["conveyor:prompt_tokens_total"] == num_prompt
    assert values["conveyor:generation_tokens_total"] == 8
    assert values["conveyor:time_to_first_token_seconds_count"] == 2
    assert values["conveyor:e2e_request_latency_seconds_count"] == 2
    assert values["conveyor:num_requests_running"] == 2
    assert values["conveyor:num_requests_waiting"] == 3
    assert values["conveyor:kv_cache_usage_perc"] == 0.25


async def test_each_app_has_its_own_metrics_registry(config, engine, tokenizer):
    first = create_app(config, engine, tokenizer).state.conveyor.metrics
    second = create_app(config, engine, tokenizer).state.conveyor.metrics
    first.record_tokens(4)
    assert samples(second.render(None).decode())["conveyor:generation_tokens_total"] == 0


async def test_health_follows_scheduler_heartbeats(config, tokenizer):
    engine = ZmqEngineClient("/nonexistent", alive_timeout_s=0.3)  # never started: frames fed by hand
    app = create_app(config, engine, tokenizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        assert (await http.get("/health")).status_code == 503  # nothing heard yet: starting
        engine.handle_frame(heartbeat(num_running=1, kv_cache_usage=0.5))
        assert (await http.get("/health")).status_code == 200
        values = samples((await http.get("/metrics")).text)
        assert values["conveyor:kv_cache_usage_perc"] == 0.5
        await asyncio.sleep(0.4)
        assert (await http.get("/health")).status_code == 503  # heartbeats stopped
        engine.handle_frame(heartbeat())
        assert (await http.get("/health")).status_code == 200
        app.state.conveyor.draining = True
        response = await http.get("/health")
        assert (response.status_code, response.json()["status"]) == (503, "draining")
