"""/metrics counts a known mix of requests exactly; /health follows the scheduler's messages."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import numpy as np
import pytest
from frontend_fakes import DECODE_STEP_S, PREFILL_S, QUEUE_S, STEP_DURATION_S
from prometheus_client.parser import text_string_to_metric_families

from frontend.app import create_app
from frontend.engine_client import ZmqEngineClient
from frontend.metrics import FrontendMetrics, one_two_five_buckets, power_of_two_buckets
from proto import codec
from proto.messages import ERROR_INVALID_REQUEST, ERROR_QUEUE_FULL, FinishReason, SchedulerStats, StepOutputs

pytestmark = pytest.mark.anyio

HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_time_per_output_token_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "iteration_tokens_total", "step_duration_seconds",
              "batch_occupancy", "request_inference_time_seconds", "request_max_num_generation_tokens",
              "request_params_n", "request_params_max_tokens")


def heartbeat(num_running: int = 0, num_waiting: int = 0, kv_cache_usage: float = 0.0,
              **totals: int) -> StepOutputs:
    return StepOutputs(
        step_id=-1, request_ids=[], cu_new_tokens=np.zeros(1, np.int32),
        new_token_ids=np.zeros(0, np.int32), finish_reasons=[], error_messages=[],
        stats=SchedulerStats(num_running=num_running, num_waiting=num_waiting, num_waiting_tokens=0,
                             kv_cache_usage=kv_cache_usage,
                             num_preemptions_total=totals.pop("num_preemptions_total", 0), **totals),
        step_duration_s=0.0, wall_time_s=123.0)


def samples(text: str) -> dict[str, float]:
    """{name or name{label="value"}: value} of the model `tiny`, buckets left out."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            if sample.labels.get("model_name") != "tiny" or "le" in labels:
                continue
            suffix = "".join(f'{{{k}="{v}"}}' for k, v in sorted(labels.items()))
            found[sample.name + suffix] = sample.value
    return found


def tokens_until(tokenizer, token_ids: list[int], text: str) -> int:
    """How many tokens of `token_ids` it takes until their text contains `text`."""
    return next(j for j in range(1, len(token_ids) + 1) if text in tokenizer.decode(token_ids[:j]))


async def run_known_mix(client, engine) -> None:
    """stop by EOS, stop by a stop string, length, and one aborted by the engine."""
    await client.post("/v1/completions", json={"prompt": "The capital", "max_tokens": 50})
    await client.post("/v1/completions", json={"prompt": "The capital", "max_tokens": 50,
                                               "stop": " capital", "stream": True})
    await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "The capital"}], "max_tokens": 3})
    engine.hang = True
    held = asyncio.create_task(client.post("/v1/completions", json={"prompt": "The capital"}))
    while len(engine.added) < 4:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the request reads the tokens that came before the abort
    engine.abort(engine.added[3].request_id)
    assert (await held).status_code == 503


async def test_known_mix_of_requests_sets_every_counter_and_histogram_count_exactly(
        client, engine, tokenizer):
    engine.num_cached_tokens, engine.preempt, engine.scheduler_protocol_errors = 2, True, 2
    await run_known_mix(client, engine)
    engine.router.protocol_error()  # one frame of our own that failed to decode
    text = (await client.get("/metrics")).text
    assert "_created" not in text  # no creation-time gauge doubles each counter's series
    values = samples(text)

    reply = engine.reply_token_ids
    num_reply, num_stopped = len(reply), tokens_until(tokenizer, reply, " capital")
    prompts = [len(added.prompt_token_ids) for added in engine.added]
    generated = [num_reply, num_stopped, 3, min(num_reply, 16)]
    # The EOS and stop-string replies finish at their last token (the fake engine sent the
    # latter's whole reply at once), length at its 3rd, the aborted one a step after its last.
    decode_s = DECODE_STEP_S * (2 * (num_reply - 1) + 2 + generated[3])
    assert values == pytest.approx({
        **values,
        "conveyor:num_requests_running": 2, "conveyor:num_requests_waiting": 3,
        "conveyor:kv_cache_usage_perc": 0.25,
        'conveyor:request_success_total{finished_reason="stop"}': 2,
        'conveyor:request_success_total{finished_reason="length"}': 1,
        'conveyor:request_success_total{finished_reason="abort"}': 1,
        'conveyor:request_success_total{finished_reason="error"}': 0,
        "conveyor:prompt_tokens_total": sum(prompts),
        "conveyor:generation_tokens_total": sum(generated),
        "conveyor:num_preemptions_total": 4,
        "conveyor:prefix_cache_queries_total": sum(prompts),
        "conveyor:prefix_cache_hits_total": 2 * 4,
        "conveyor:protocol_errors_total": 3,
        "conveyor:padded_slot_steps_total": 0,
        "conveyor:time_to_first_token_seconds_count": 4,
        "conveyor:inter_token_latency_seconds_count": sum(generated) - 4,
        "conveyor:e2e_request_latency_seconds_count": 4,
        "conveyor:request_time_per_output_token_seconds_count": sum(n >= 2 for n in generated),
        "conveyor:request_prompt_tokens_count": 4,
        "conveyor:request_prompt_tokens_sum": sum(prompts),
        "conveyor:request_generation_tokens_count": 4,
        "conveyor:request_generation_tokens_sum": sum(generated),
        "conveyor:request_queue_time_seconds_count": 4,
        "conveyor:request_queue_time_seconds_sum": 4 * QUEUE_S,
        "conveyor:request_prefill_time_seconds_count": 4,
        "conveyor:request_prefill_time_seconds_sum": 4 * PREFILL_S,
        "conveyor:request_decode_time_seconds_count": 4,
        "conveyor:request_decode_time_seconds_sum": decode_s,
        "conveyor:request_inference_time_seconds_count": 4,
        "conveyor:request_inference_time_seconds_sum": 4 * PREFILL_S + decode_s,
        "conveyor:request_params_n_count": 4,
        "conveyor:request_params_n_sum": 4,
        "conveyor:request_params_max_tokens_sum": 50 + 50 + 3 + 16,  # completions' default is 16
        "conveyor:request_max_num_generation_tokens_sum": sum(generated),
        "conveyor:iteration_tokens_total_count": engine.num_steps,
        "conveyor:iteration_tokens_total_sum": engine.num_scheduled_tokens_total,
        "conveyor:step_duration_seconds_count": engine.num_steps,
        "conveyor:step_duration_seconds_sum": engine.num_steps * STEP_DURATION_S,
        "conveyor:batch_occupancy_count": engine.num_steps,
        "conveyor:batch_occupancy_sum": engine.num_steps * 2 / 64,  # 2 running of max_num_seqs 64
    })
    assert set(f"conveyor:{name}_count" for name in HISTOGRAMS) <= set(values)


async def test_n_choices_count_one_prompt_and_every_choice(client, engine):
    engine.choice_replies = [engine.reply_token_ids[:5], engine.reply_token_ids[:2]]
    response = await client.post("/v1/completions", json={"prompt": "The capital", "n": 2})
    assert response.status_code == 200, response.text
    values = samples((await client.get("/metrics")).text)
    num_prompt = len(engine.added[0].prompt_token_ids)
    assert values["conveyor:prompt_tokens_total"] == num_prompt
    assert values["conveyor:request_prompt_tokens_count"] == 1
    assert values['conveyor:request_success_total{finished_reason="stop"}'] == 2
    assert values["conveyor:generation_tokens_total"] == 7
    assert values["conveyor:time_to_first_token_seconds_count"] == 2
    assert values["conveyor:inter_token_latency_seconds_count"] == 7 - 2
    assert values["conveyor:request_decode_time_seconds_count"] == 2
    assert values["conveyor:request_params_n_sum"] == 2
    assert values["conveyor:request_max_num_generation_tokens_sum"] == 5  # the longer choice's
    assert values["conveyor:request_max_num_generation_tokens_count"] == 1


async def test_cache_config_info_labels_the_kv_cache_settings(client, config):
    families = {f.name: f for f in text_string_to_metric_families((await client.get("/metrics")).text)}
    (sample,) = families["conveyor:cache_config_info"].samples
    assert sample.value == 1
    assert sample.labels == {"model_name": "tiny", "block_size": str(config.block_size),
                             "cache_dtype": config.kv_dtype,
                             "enable_prefix_caching": str(config.enable_prefix_caching),
                             "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes),
                             "gpu_memory_utilization": str(config.gpu_memory_utilization),
                             "num_kv_blocks": str(config.num_kv_blocks or "auto")}


@pytest.mark.parametrize("code, status", [(ERROR_QUEUE_FULL, 429), (ERROR_INVALID_REQUEST, 400)])
async def test_a_request_the_scheduler_refuses_is_a_rejection_not_a_finished_request(client, engine, code, status):
    engine.fail_with, engine.fail_code = "refused", code
    response = await client.post("/v1/completions", json={"prompt": "The capital", "n": 2})
    assert response.status_code == status
    values = samples((await client.get("/metrics")).text)
    assert values.get('conveyor:request_rejected_total{reason="max_num_waiting"}', 0) == (status == 429)
    for name in ('conveyor:request_success_total{finished_reason="error"}', "conveyor:e2e_request_latency_seconds_count",
                 "conveyor:request_prompt_tokens_count", "conveyor:request_generation_tokens_count"):
        assert values.get(name, 0) == 0, name
    engine.fail_with = ""
    assert (await client.post("/v1/completions", json={"prompt": "The capital"})).status_code == 200
    values = samples((await client.get("/metrics")).text)
    assert values['conveyor:request_success_total{finished_reason="stop"}'] == 1
    assert values["conveyor:e2e_request_latency_seconds_count"] == 1


def test_time_per_output_token_is_a_choices_decode_time_over_its_tokens_after_the_first():
    metrics = FrontendMetrics("tiny")
    metrics.record_choice_finished(FinishReason.STOP, 2.0, 5, decode_s=1.0)  # 4 tokens in 1 s after the first
    metrics.record_choice_finished(FinishReason.LENGTH, 2.0, 1, decode_s=0.0)  # one token: no time per token
    metrics.record_choice_finished(FinishReason.ABORT, 2.0, 0)  # never got a token
    values = samples(metrics.render().decode())
    assert values["conveyor:request_time_per_output_token_seconds_count"] == 1
    assert values["conveyor:request_time_per_output_token_seconds_sum"] == pytest.approx(0.25)
    assert values["conveyor:e2e_request_latency_seconds_count"] == 3


async def test_scheduler_totals_become_counters_that_never_go_backwards():
    metrics = FrontendMetrics("tiny")
    for total in (5, 3, 0, 7):  # a message that does not carry a total reads as lower
        metrics.on_step_outputs(heartbeat(num_preemptions_total=total, prefix_cache_hits_total=total))
    values = samples(metrics.render().decode())
    assert values["conveyor:num_preemptions_total"] == 7
    assert values["conveyor:prefix_cache_hits_total"] == 7
    assert values["conveyor:iteration_tokens_total_count"] == 0  # heartbeats are no steps


def test_a_restarted_frontend_adds_the_running_schedulers_worker_restarts_to_the_earlier_ones():
    """The supervisor hands a new frontend the worker groups replaced under earlier schedulers (2);
    the running scheduler's own (1, replaced while this frontend started) arrive in its report."""
    metrics = FrontendMetrics("tiny")
    metrics.continue_restart_counts({"frontend": 1, "scheduler": 1, "worker": 2})
    for total in (1, 1):
        metrics.on_step_outputs(heartbeat(num_worker_restarts_total=total))
    values = samples(metrics.render().decode())
    assert values['conveyor:process_restarts_total{process="worker"}'] == 3
    assert values['conveyor:process_restarts_total{process="frontend"}'] == 1


async def test_frontend_decode_errors_count_as_protocol_errors(config, tokenizer):
    engine = ZmqEngineClient("/nonexistent")  # never started: frames fed by hand
    app = create_app(config, engine, tokenizer)
    engine.handle_frame(b"\x93not a message")
    engine.handle_frame(codec.encode(heartbeat(num_protocol_errors_total=2)))
    values = samples(app.state.conveyor.metrics.render().decode())
    assert values["conveyor:protocol_errors_total"] == 3


def test_token_count_buckets_follow_vllms_1_2_5_and_powers_of_two():
    assert one_two_five_buckets(128) == (1, 2, 5, 10, 20, 50, 100)
    assert power_of_two_buckets(100) == (1, 8, 16, 32, 64, 128)


async def test_each_app_has_its_own_metrics_registry(config, engine, tokenizer):
    first = create_app(config, engine, tokenizer).state.conveyor.metrics
    second = create_app(config, engine, tokenizer).state.conveyor.metrics
    first.record_choice_tokens(4, 0.1, first=True)
    assert samples(second.render().decode())["conveyor:generation_tokens_total"] == 0


async def test_every_http_answer_is_counted_by_route_method_and_status(config, make_http):
    async with make_http(config.with_updates(api_key="sesame", max_num_seqs=1, max_num_waiting=1)) as http:
        key = {"Authorization": "Bearer sesame"}
        await http.get("/v1/models", headers=key)
        await http.get("/v1/models/tiny", headers=key)
        await http.get("/v1/models/other", headers=key)
        await http.post("/v1/completions", json={"prompt": "x"})  # no key: 401 before routing
        await http.post("/v1/completions", json={"prompt": "x", "n": 99}, headers=key)
        await http.get("/no/such/path")
        await http.request("BREW", "/no/such/path")  # any token is a method to HTTP: not a label
        text = (await http.get("/metrics")).text
    found = samples(text)
    http_requests = {name: value for name, value in found.items() if name.startswith("conveyor:http_requests_total")}
    assert http_requests == {
        'conveyor:http_requests_total{handler="/v1/models"}{method="GET"}{status="200"}': 1.0,
        'conveyor:http_requests_total{handler="/v1/models/{model:path}"}{method="GET"}{status="200"}': 1.0,
        'conveyor:http_requests_total{handler="/v1/models/{model:path}"}{method="GET"}{status="404"}': 1.0,
        'conveyor:http_requests_total{handler="/v1/completions"}{method="POST"}{status="401"}': 1.0,
        'conveyor:http_requests_total{handler="/v1/completions"}{method="POST"}{status="400"}': 1.0,
        'conveyor:http_requests_total{handler="other"}{method="GET"}{status="404"}': 1.0,
        'conveyor:http_requests_total{handler="other"}{method="other"}{status="404"}': 1.0}
    assert "process_resident_memory_bytes" in text  # the frontend's own memory, to alert on


async def test_health_follows_scheduler_heartbeats(config, tokenizer):
    # Never started: frames fed by hand. 1 s of silence means hung: long enough for two requests
    # on a loaded machine, short enough to wait out.
    engine = ZmqEngineClient("/nonexistent", alive_timeout_s=1.0)
    app = create_app(config, engine, tokenizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        response = await http.get("/health")
        assert (response.status_code, response.json()["status"]) == (503, "starting")
        engine.handle_frame(codec.encode(heartbeat(num_running=1, kv_cache_usage=0.5)))
        assert (await http.get("/health")).status_code == 200
        values = samples((await http.get("/metrics")).text)
        assert values["conveyor:kv_cache_usage_perc"] == 0.5
        await asyncio.sleep(1.1)
        response = await http.get("/health")  # heartbeats stopped: hung or dead
        assert (response.status_code, response.json()["status"]) == (503, "engine_unavailable")
        refused = await http.post("/v1/completions", json={"prompt": "x"})
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "engine_unavailable")
        assert refused.headers["retry-after"] == "5"
        engine.handle_frame(codec.encode(dataclasses.replace(heartbeat(), step_id=3)))
        assert (await http.get("/health")).status_code == 200
        # Heartbeats during a step say how long it has run and how long its ranks have computed
        # nothing: a long step that computes is healthy, ranks idle past --stall-timeout hang.
        engine.handle_frame(codec.encode(heartbeat(step_running_s=config.stall_timeout_s * 3, step_idle_s=0.5)))
        assert (await http.get("/health")).status_code == 200
        engine.handle_frame(codec.encode(heartbeat(step_running_s=config.stall_timeout_s - 0.5,
                                                   step_idle_s=config.stall_timeout_s - 0.5)))
        assert (await http.get("/health")).status_code == 200
        engine.handle_frame(codec.encode(heartbeat(step_running_s=config.stall_timeout_s + 0.04,
                                                   step_idle_s=config.stall_timeout_s + 0.04)))
        response = await http.get("/health")
        assert response.status_code == 503
        assert response.json() == {"status": "stalled", "step_running_s": round(config.stall_timeout_s, 1),
                                   "step_idle_s": round(config.stall_timeout_s, 1)}
        engine.handle_frame(codec.encode(dataclasses.replace(heartbeat(), step_id=4)))  # the step ended
        assert (await http.get("/health")).status_code == 200
        assert [(r.status_code, r.json()) for r in (await http.get("/ping"), await http.post("/ping"))] == [
            (200, {"status": "ok"})] * 2  # vLLM's /ping answers as /health does
        app.state.conveyor.draining = True
        response = await http.get("/health")
        assert (response.status_code, response.json()["status"]) == (503, "draining")
        assert (await http.post("/ping")).status_code == 503
