"""/metrics and /health through the real stack: a known mix of requests, a hung scheduler."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deploy.launcher import Stack

PROMPT = "The quick brown fox jumps over the lazy dog. " * 5  # a few full KV blocks
SUCCESS = 'conveyor:request_success_total{finished_reason="%s"}'
PER_STEP = ("iteration_tokens_total", "step_duration_seconds", "batch_occupancy")
ABANDONED_MAX_TOKENS = 400


def scrape(base_url: str) -> dict[str, float]:
    """{name or name{finished_reason="..."}: value} for model `tiny`, buckets left out."""
    found = {}
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") != "tiny" or "le" in sample.labels:
                continue
            reason = sample.labels.get("finished_reason")
            suffix = "" if reason is None else f'{{finished_reason="{reason}"}}'
            found[sample.name + suffix] = sample.value
    return found


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def complete(base_url: str, **body: object) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, **body}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def abandon_a_stream(base_url: str) -> None:
    """Start a long stream, hang up after its first text chunk: the frontend aborts it."""
    body = {"model": "tiny", "prompt": "Abandon " + PROMPT, "max_tokens": ABANDONED_MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break


def test_known_mix_of_requests_sets_every_counter_and_histogram_count(stack: Stack) -> None:
    before = scrape(stack.url)
    by_length = complete(stack.url, max_tokens=8, ignore_eos=True)  # finished by length
    text = by_length["choices"][0]["text"]
    assert by_length["choices"][0]["finish_reason"] == "length" and len(text) >= 2
    by_stop = complete(stack.url, max_tokens=8, ignore_eos=True, stop=text[-2:])
    assert by_stop["choices"][0]["finish_reason"] == "stop"
    abandon_a_stream(stack.url)
    num_abandoned_prompt = httpx.post(f"{stack.url}/tokenize", json={"prompt": "Abandon " + PROMPT},
                                      timeout=10).json()["count"]

    def delta(name: str) -> float:
        return scrape(stack.url)[name] - before.get(name, 0.0)

    # The abort reaches the scheduler after the client left; its FINISHED event a step later.
    wait_for(lambda: delta("conveyor:request_decode_time_seconds_count") == 3, 20, "3 decode times")
    wait_for(lambda: scrape(stack.url)["conveyor:num_requests_running"] == 0, 20, "an idle batch")
    after = scrape(stack.url)
    got = {name: after[name] - before.get(name, 0.0) for name in after}
    num_prompt = by_length["usage"]["prompt_tokens"]
    assert by_stop["usage"]["prompt_tokens"] == num_prompt
    assert by_stop["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # by_length's prompt
    prompts = 2 * num_prompt + num_abandoned_prompt
    assert [got[SUCCESS % r] for r in ("stop", "length", "abort", "error")] == [1, 1, 1, 0]
    assert got["conveyor:prompt_tokens_total"] == prompts
    assert (got["conveyor:request_prompt_tokens_count"], got["conveyor:request_prompt_tokens_sum"]) \
        == (3, prompts)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_generation_tokens", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_params_n", "request_max_num_generation_tokens"):
        assert got[f"conveyor:{name}_count"] == 3, name
    generated = got["conveyor:generation_tokens_total"]
    assert generated == got["conveyor:request_generation_tokens_sum"]
    assert generated >= 8 + by_stop["usage"]["completion_tokens"] + 1
    assert got["conveyor:inter_token_latency_seconds_count"] == generated - 3  # one token a step
    num_steps = got["conveyor:iteration_tokens_total_count"]
    assert num_steps >= generated / 3 and all(got[f"conveyor:{n}_count"] == num_steps for n in PER_STEP)
    assert got["conveyor:iteration_tokens_total_sum"] >= generated - 3
    # The frontend stops counting the abandoned stream's tokens when its client leaves, whatever the
    # scheduler does; what the workers computed shows the abort: most of its max_tokens never ran.
    num_computed = got["conveyor:iteration_tokens_total_sum"]
    assert num_computed < prompts + 2 * 8 + ABANDONED_MAX_TOKENS // 2, f"{num_computed} tokens computed"
    assert 0 < got["conveyor:prefix_cache_hits_total"] <= got["conveyor:prefix_cache_queries_total"]
    assert got["conveyor:protocol_errors_total"] == 0 and got["conveyor:padded_slot_steps_total"] == 0
    assert got["conveyor:num_preemptions_total"] == 0
    assert after["conveyor:num_requests_waiting"] == 0 and after["conveyor:kv_cache_usage_perc"] == 0


def test_health_is_503_while_the_scheduler_is_stopped_and_200_once_it_runs_again(stack: Stack) -> None:
    def health() -> int:
        return httpx.get(f"{stack.url}/health", timeout=10).status_code

    assert health() == 200
    scheduler = next(child for child in stack.children if child.name == "scheduler")
    os.kill(scheduler.process.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: health() == 503, 20, "/health to turn 503 for a hung scheduler")
        body = httpx.get(f"{stack.url}/health", timeout=10).json()
        assert body["status"] == "engine_unavailable"
    finally:
        os.kill(scheduler.process.pid, signal.SIGCONT)
    wait_for(lambda: health() == 200, 20, "/health to recover once the scheduler runs again")
    assert complete(stack.url, max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_the_scheduler_and_worker_memory_are_exported_beside_the_frontends(stack: Stack) -> None:
    complete(stack.url, max_tokens=2)
    resident: dict[str, float] = {}

    def scraped_both() -> bool:
        text = httpx.get(f"{stack.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "conveyor:process_resident_memory_bytes":
                    resident[sample.labels["process"]] = sample.value
                elif sample.name == "process_resident_memory_bytes":
                    resident["frontend"] = sample.value
        return len(resident) == 3 and all(resident.values())

    wait_for(scraped_both, 10.0, "the three processes' memory in /metrics")
    assert resident["workers"] > resident["scheduler"]  # the workers hold the weights and the KV cache
