"""`python -m frontend` as a real process: readiness report, start-up failures, SIGTERM drain."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import zmq

from proto import codec, sockets
from proto.config import EngineConfig
from proto.control import ProcessFailed, ProcessReady
from proto.messages import AbortRequest, AddRequest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def control(runtime_dir: str) -> Iterator[zmq.Socket]:
    """The supervisor's end of the CONTROL channel."""
    context = zmq.Context()
    sock = sockets.bind(context, zmq.PULL, runtime_dir, sockets.CONTROL)
    yield sock
    sock.close()
    context.term()


def start_frontend(config: EngineConfig) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "frontend", "--config", config.to_json()],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@contextmanager
def frontend_process(config: EngineConfig) -> Iterator[subprocess.Popen]:
    """`python -m frontend`, killed if it still runs and reaped on the way out."""
    process = start_frontend(config)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def report(control: zmq.Socket, process: subprocess.Popen) -> object:
    frame = sockets.recv_ready(control, 30.0)
    if frame is None:
        process.kill()
        pytest.fail(f"no report from the frontend; its output:\n{process.communicate()[0].decode()}")
    return codec.decode(frame, sockets.CONTROL_MESSAGES)


def frontend_config(model_dir: Path, runtime_dir: str, port: int = 0,
                    shutdown_timeout_s: float = 10.0) -> EngineConfig:
    return EngineConfig(model=str(model_dir), served_model_name="tiny", runtime_dir=runtime_dir,
                        port=port, max_model_len=128, vocab_size=512,
                        shutdown_timeout_s=shutdown_timeout_s, log_level="warning")


def post_in_background(url: str, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    results: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: results.append(
        httpx.post(f"{url}/v1/completions", json=body, timeout=20)))
    thread.start()
    return thread, results


def wait_for_health(url: str) -> None:
    """Ready means listening; /health turns 200 once the frontend has heard from the scheduler
    (its first heartbeat may land after the readiness report on a loaded machine)."""
    deadline = time.monotonic() + 10
    while (status := httpx.get(f"{url}/health").status_code) != 200:
        assert status == 503 and time.monotonic() < deadline, f"/health stayed {status}"
        time.sleep(0.02)


def wait_for_add_request(scheduler) -> None:
    deadline = time.monotonic() + 10
    while not any(isinstance(m, AddRequest) for m in scheduler.received):
        assert time.monotonic() < deadline, "the scheduler never got the request"
        time.sleep(0.01)


def hold_a_request(control: zmq.Socket, process: subprocess.Popen,
                   fake_scheduler) -> tuple[threading.Thread, list[httpx.Response]]:
    """Once the frontend serves: a completion the fake scheduler has queued and never answers."""
    url = report(control, process).detail
    wait_for_health(url)
    held, results = post_in_background(url, {"prompt": [0, 1]})
    wait_for_add_request(fake_scheduler)
    return held, results


def test_frontend_reports_ready_serves_and_drains_on_sigterm(tiny_model_dir, runtime_dir, control,
                                                             fake_scheduler):
    fake_scheduler.answer_delay_s = 1.5  # keeps one request in flight while we send SIGTERM
    with frontend_process(frontend_config(tiny_model_dir, runtime_dir)) as process:
        ready = report(control, process)
        assert isinstance(ready, ProcessReady) and ready.name == "frontend" and ready.pid == process.pid
        url = ready.detail
        wait_for_health(url)
        in_flight, results = post_in_background(url, {"prompt": [5, 6], "max_tokens": 2})
        wait_for_add_request(fake_scheduler)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(f"{url}/health")
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "draining")
        assert refused.headers["retry-after"] == "5"  # OpenAI's clients retry after that long
        in_flight.join(timeout=20)
        assert results[0].status_code == 200, results[0].text
        assert results[0].json()["usage"]["completion_tokens"] == 2
        assert process.wait(timeout=15) == 0


def test_requests_still_running_at_the_shutdown_timeout_are_aborted_with_an_answer(
        tiny_model_dir, runtime_dir, control, fake_scheduler):
    with frontend_process(frontend_config(tiny_model_dir, runtime_dir, shutdown_timeout_s=0.5)) as process:
        held, results = hold_a_request(control, process, fake_scheduler)
        process.send_signal(signal.SIGTERM)
        held.join(timeout=20)
        assert (results[0].status_code, results[0].headers["retry-after"]) == (503, "5")
        assert "shutting down" in results[0].json()["error"]["message"]
        assert process.wait(timeout=15) == 0
        request_id = fake_scheduler.received[0].request_id

        def aborted() -> bool:  # the whole request: no choice indices
            return any(isinstance(m, AbortRequest) and m.request_ids == [request_id]
                       and not len(m.choice_indices) for m in fake_scheduler.received)

        deadline = time.monotonic() + 5
        while not aborted() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert aborted()


def test_a_second_signal_aborts_what_is_in_flight_with_an_answer_and_stops_at_once(
        tiny_model_dir, runtime_dir, control, fake_scheduler):
    with frontend_process(frontend_config(tiny_model_dir, runtime_dir, shutdown_timeout_s=60.0)) as process:
        held, results = hold_a_request(control, process, fake_scheduler)
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert held.is_alive()  # the first signal drains: it waits for the request
        started_s = time.monotonic()
        process.send_signal(signal.SIGINT)
        held.join(timeout=20)
        assert results[0].status_code == 503 and "shutting down" in results[0].json()["error"]["message"]
        assert process.wait(timeout=15) == 0
        assert time.monotonic() - started_s < 10.0  # not the 60 s shutdown timeout


def test_busy_port_is_reported_as_process_failed(tiny_model_dir, runtime_dir, control):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        process = start_frontend(frontend_config(tiny_model_dir, runtime_dir, port=port))
        failed = report(control, process)
        assert process.wait(timeout=15) == 1
    assert isinstance(failed, ProcessFailed)
    assert f"cannot listen on 127.0.0.1:{port}" in failed.message
    assert "in use" in failed.message


def test_model_without_tokenizer_is_reported_as_process_failed(tmp_path, runtime_dir, control):
    process = start_frontend(frontend_config(tmp_path, runtime_dir))
    failed = report(control, process)
    assert process.wait(timeout=15) == 1
    assert isinstance(failed, ProcessFailed) and "no tokenizer.json" in failed.message
