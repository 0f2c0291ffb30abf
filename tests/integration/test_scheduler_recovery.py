"""A scheduler that dies or hangs mid-generation is replaced with its worker group, and the frontend
resubmits every open request to the new one, continuing from the tokens its clients have: every
stream finishes as if nothing happened (faults injected through the real launcher with
CONVEYOR_SCHEDULER_FAULT, read only by the scheduler loop)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import pytest
from support import (HealthWatch, assert_health_follows_recovery, children_of, metric_value, recovery_workload,
                     stream_burst, supervised, tiny_config, watched_stream)

from deploy.launcher import Stack

PROMPTS, PARAMS = recovery_workload("Scheduler recovery", seed_base=200)
MAX_TOKENS = 24


def run_burst(url: str) -> list[tuple[str, str]]:
    return stream_burst(url, PROMPTS, PARAMS, MAX_TOKENS, timeout_s=180)


@pytest.fixture(scope="module")
def undisturbed(stack: Stack) -> list[tuple[str, str]]:
    return run_burst(stack.url)


def faulty_stack(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, fault: str, **config: object) -> Stack:
    monkeypatch.setenv("CONVEYOR_SCHEDULER_FAULT", fault)
    return Stack(tiny_config(tiny_model_dir, **config))


def scheduler_pid(stack: Stack) -> int:
    return next(c.process.pid for c in stack.children if c.module == "scheduler_proc")


@pytest.mark.parametrize("action", ["kill", "exit"])
def test_eight_streams_finish_with_undisturbed_text_when_the_scheduler_dies_mid_generation(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        undisturbed: list[tuple[str, str]], action: str) -> None:
    fault = f"step=6,action={action},once={tmp_path / 'fired'}"
    with faulty_stack(tiny_model_dir, monkeypatch, fault) as stack, supervised(stack) as reasons:
        first_pid = scheduler_pid(stack)
        workers = [c.process.pid for c in stack.children if c.module == "worker_proc"]
        assert run_burst(stack.url) == undisturbed
        assert (tmp_path / "fired").exists()
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="scheduler") == 1
        assert metric_value(stack.url, "conveyor:request_success_total", finished_reason="error") == 0
        assert scheduler_pid(stack) != first_pid
        assert [c.process.pid for c in stack.children if c.module == "worker_proc"] != workers
        assert httpx.get(f"{stack.url}/health", timeout=5).status_code == 200
        assert not reasons  # the watch still runs


def test_health_is_503_within_a_second_of_the_scheduler_being_killed_and_200_within_a_second_of_serving_again(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fired = tmp_path / "fired"
    with faulty_stack(tiny_model_dir, monkeypatch, f"step=6,action=kill,once={fired}") as stack, supervised(stack):
        arrivals, samples = watched_stream(stack.url, PROMPTS[0], MAX_TOKENS)
    assert_health_follows_recovery(samples, fired.stat().st_mtime, arrivals)


def test_a_hung_scheduler_is_reported_replaced_and_its_streams_finish_with_undisturbed_text(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        undisturbed: list[tuple[str, str]]) -> None:
    fired = tmp_path / "fired"
    with faulty_stack(tiny_model_dir, monkeypatch, f"step=6,action=stall,once={fired}") as stack, \
            supervised(stack):
        first_pid = scheduler_pid(stack)
        health = HealthWatch(stack.url)
        health.start()
        try:
            assert run_burst(stack.url) == undisturbed
        finally:
            health.finish()
        assert scheduler_pid(stack) != first_pid
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="scheduler") == 1
        stalled_s = fired.stat().st_mtime
        unhealthy = [t for t, code in health.samples if t > stalled_s and code == 503]
        assert unhealthy and unhealthy[0] - stalled_s < 15.0  # /health 503 within 15 s of the hang
        assert health.samples[-1][1] == 200 or httpx.get(f"{stack.url}/health", timeout=5).status_code == 200


def test_past_max_restarts_the_stack_stops_naming_the_scheduler_and_leaves_no_process(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with faulty_stack(tiny_model_dir, monkeypatch, "step=2,action=exit", max_restarts=2) as stack:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
        sender = threading.Thread(target=lambda: _post_quietly(stack.url, body), daemon=True)
        sender.start()
        reason = stack.watch(lambda: False, poll_s=0.2)  # returns once the stack must stop
        children = [c.process.pid for c in stack.children]
    assert "scheduler" in reason and "exited with code 1" in reason and "--max-restarts 2" in reason
    assert reason.count("exited with code 1") == 3  # this fault and the two restarted for
    assert not [pid for pid in children_of(os.getpid()) if pid in children]


def _post_quietly(url: str, body: dict) -> None:
    try:
        httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError:
        pass
