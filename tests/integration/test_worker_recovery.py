"""A worker that dies or hangs mid-generation is replaced and every request finishes as if nothing
happened: the same text, no error, no lost or repeated token (faults injected through the real
launcher with CONVEYOR_FAULT_INJECTION, read only by the worker loop)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support import children_of, metric_value, recovery_workload, stream_burst, supervised, tiny_config

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


@pytest.mark.parametrize("action", ["kill", "exit", "stall"])
def test_eight_streams_finish_with_undisturbed_text_when_a_worker_dies_or_hangs_mid_generation(
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


def test_two_faults_in_a_row_and_a_tensor_parallel_rank_are_recovered_too(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        undisturbed: list[tuple[str, str]]) -> None:
    faults = (f"rank=1,step=4,action=kill,once={tmp_path / 'first'};"
              f"rank=0,step=9,action=kill,once={tmp_path / 'second'}")
    with faulty_stack(tiny_model_dir, monkeypatch, faults, tensor_parallel_size=2) as stack, supervised(stack):
        assert run_burst(stack.url) == undisturbed
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="worker") == 2


def test_health_is_503_while_the_group_is_replaced_and_200_once_it_serves(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    faults = f"rank=0,step=3,action=stall,once={tmp_path / 'fired'}"
    with faulty_stack(tiny_model_dir, monkeypatch, faults, step_timeout_s=2.0) as stack, supervised(stack):
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{stack.url}/v1/completions", json=body, timeout=60)
            statuses = []
            deadline = time.monotonic() + 60
            while not pending.done() and time.monotonic() < deadline:
                statuses.append(httpx.get(f"{stack.url}/health", timeout=5).status_code)
                time.sleep(0.2)
            response = pending.result()
        statuses.append(httpx.get(f"{stack.url}/health", timeout=5).status_code)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    assert 503 in statuses and statuses[-1] == 200  # 503 while replaced, then serving again


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
