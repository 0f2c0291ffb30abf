"""A worker that dies or hangs mid-generation is replaced and every request finishes as if nothing
happened: the same text, no error, no lost or repeated token (faults injected through the real
launcher with CONVEYOR_FAULT_INJECTION, read only by the worker loop)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support import (HealthWatch, assert_health_follows_recovery, caplog_of, children_of, metric_value,
                     recovery_workload, stream_burst, supervised, tiny_config, watched_stream)

from deploy.launcher import Stack, StartupError

PROMPTS, PARAMS = recovery_workload("Recovery", seed_base=100)
MAX_TOKENS = 24


def run_burst(url: str) -> list[tuple[str, str]]:
    return stream_burst(url, PROMPTS, PARAMS, MAX_TOKENS, timeout_s=120)


@pytest.fixture(scope="module")
def undisturbed(stack: Stack) -> list[tuple[str, str]]:
    return run_burst(stack.url)


def faulty_stack(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, faults: str,
                 **config: object) -> Stack:
    monkeypatch.setenv("CONVEYOR_FAULT_INJECTION", faults)
    return Stack(tiny_config(tiny_model_dir, **config))


@pytest.mark.parametrize("action", ["kill", "exit", "stall", "segv", "raise"])
def test_eight_streams_finish_with_undisturbed_text_when_a_worker_dies_hangs_or_raises_mid_generation(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        undisturbed: list[tuple[str, str]], action: str) -> None:
    faults = f"rank=0,step=6,action={action},once={tmp_path / 'fired'}"
    with faulty_stack(tiny_model_dir, monkeypatch, faults, step_timeout_s=3.0) as stack, supervised(stack):
        workers = [c.process.pid for c in stack.children if c.module == "worker_proc"]
        assert run_burst(stack.url) == undisturbed
        assert (tmp_path / "fired").exists()
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="worker") == 1
        assert metric_value(stack.url, "conveyor:requests_recovered_total") >= 1
        assert metric_value(stack.url, 'conveyor:request_success_total', finished_reason="error") == 0
        assert [c.process.pid for c in stack.children if c.module == "worker_proc"] != workers
        assert httpx.get(f"{stack.url}/health", timeout=5).status_code == 200


@pytest.mark.ranks(2)
def test_two_faults_in_a_row_and_a_tensor_parallel_rank_are_recovered_too(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        undisturbed: list[tuple[str, str]]) -> None:
    faults = (f"rank=1,step=4,action=kill,once={tmp_path / 'first'};"
              f"rank=0,step=9,action=kill,once={tmp_path / 'second'}")
    with faulty_stack(tiny_model_dir, monkeypatch, faults, tensor_parallel_size=2) as stack, supervised(stack):
        assert run_burst(stack.url) == undisturbed
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="worker") == 2


@pytest.mark.ranks(2)
def test_a_tensor_parallel_rank_that_raises_is_named_not_the_rank_its_collective_then_timed_out(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        undisturbed: list[tuple[str, str]]) -> None:
    faults = f"rank=1,step=6,action=raise,once={tmp_path / 'fired'}"
    with faulty_stack(tiny_model_dir, monkeypatch, faults, tensor_parallel_size=2, step_timeout_s=6.0) as stack, \
            supervised(stack), caplog_of("conveyor.deploy") as records:
        assert run_burst(stack.url) == undisturbed
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="worker") == 1
    log = "\n".join(records)  # rank 0 failed too, 3 s later, waiting in a collective for rank 1
    assert "worker1 (pid" in log and "worker rank 1 failed step" in log and "injected fault" in log, log


@pytest.mark.parametrize("action", ["kill", "raise"])
def test_health_is_503_within_a_second_of_a_worker_fault_and_200_within_a_second_of_serving_again(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str) -> None:
    fired = tmp_path / "fired"
    with faulty_stack(tiny_model_dir, monkeypatch, f"rank=0,step=6,action={action},once={fired}") as stack, \
            supervised(stack):
        arrivals, samples = watched_stream(stack.url, PROMPTS[0], MAX_TOKENS)
    assert_health_follows_recovery(samples, fired.stat().st_mtime, arrivals)


def test_a_hung_worker_turns_health_503_within_the_stall_timeout_and_200_once_replaced(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fired = tmp_path / "fired"
    with faulty_stack(tiny_model_dir, monkeypatch, f"rank=0,step=6,action=stall,once={fired}",
                      step_timeout_s=4.0, stall_timeout_s=2.0) as stack, supervised(stack):
        arrivals, samples = watched_stream(stack.url, PROMPTS[0], MAX_TOKENS)
    assert_health_follows_recovery(samples, fired.stat().st_mtime, arrivals, within_s=2.0 + 1.0)


def test_a_worker_killed_while_the_server_is_idle_is_replaced_and_the_next_requests_are_served(
        tiny_model_dir: Path, undisturbed: list[tuple[str, str]]) -> None:
    with Stack(tiny_config(tiny_model_dir)) as stack, supervised(stack):
        health = HealthWatch(stack.url, period_s=0.05)
        health.start()
        try:
            time.sleep(0.5)
            worker = next(c.process.pid for c in stack.children if c.module == "worker_proc")
            killed_s = time.time()
            os.kill(worker, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while not [t for t, code in health.samples if t > killed_s and code == 503] and time.monotonic() < deadline:
                time.sleep(0.05)
            while health.samples[-1][1] != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            health.finish()
        unhealthy = next(t for t, code in health.samples if t > killed_s and code == 503)
        assert unhealthy - killed_s < 1.0  # no step was in flight: the scheduler watches its ranks anyway
        assert run_burst(stack.url) == undisturbed
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="worker") == 1


def test_requests_that_arrive_while_the_group_is_replaced_wait_in_the_queue_and_finish(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        undisturbed: list[tuple[str, str]]) -> None:
    fired = tmp_path / "fired"
    with faulty_stack(tiny_model_dir, monkeypatch, f"rank=0,step=6,action=kill,once={fired}") as stack, \
            supervised(stack), ThreadPoolExecutor(2) as pool:
        health = HealthWatch(stack.url, period_s=0.05)
        health.start()
        try:
            first = pool.submit(run_burst, stack.url)
            while not any(code == 503 for _, code in health.samples) and not first.done():
                time.sleep(0.01)
            arrived_s = time.time()
            second = pool.submit(run_burst, stack.url)  # while no group serves
            assert first.result() == undisturbed and second.result() == undisturbed
        finally:
            health.finish()
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="worker") == 1
    # They were sent while /health was 503 (no group served): they waited in the queue, not refused.
    lost_s = next(t for t, code in health.samples if code == 503)
    assert arrived_s < next(t for t, code in health.samples if t > lost_s and code == 200)


def test_past_max_restarts_the_stack_stops_naming_the_worker_and_its_causes_and_leaves_no_process(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ThreadPoolExecutor(1) as pool:
        with faulty_stack(tiny_model_dir, monkeypatch, "rank=0,step=2,action=exit", max_restarts=2) as stack:
            body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
            pending = pool.submit(httpx.post, f"{stack.url}/v1/completions", json=body, timeout=120)
            reason = stack.watch(lambda: False, poll_s=0.2)  # returns once the stack must stop
            children = [c.process.pid for c in stack.children]
        response = pending.result()  # the frontend drains: the request gets its terminal answer
    assert response.status_code != 200  # the request ended with the stack, as an error
    message = response.json()["error"]["message"]
    assert "worker rank 0 did not answer step" in message and "rank 0 died" in message  # not just "stopping"
    assert "worker0" in reason and "exited with code 1" in reason and "--max-restarts 2" in reason
    assert reason.count("exited with code 1") == 3  # this fault and the two restarted for
    assert not [pid for pid in children_of(os.getpid()) if pid in children]


def test_a_bad_fault_spec_stops_the_worker_at_start_up_with_the_reason(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StartupError, match="CONVEYOR_FAULT_INJECTION: cannot read 'rank=0'"):
        with faulty_stack(tiny_model_dir, monkeypatch, "rank=0"):
            pass
