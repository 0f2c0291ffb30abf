"""Through the real processes: 401 without the API key, 429 once the seats and the waiting queue are full."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support import metric_value, tiny_config

from deploy.launcher import Stack

API_KEY = "sesame"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 480  # long enough to hold a seat while the queue fills (the tiny model holds 512 positions)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One seat and room for two waiting sequences: the frontend lets 1 + 2 requests in flight."""
    config = tiny_config(tiny_model_dir, api_key=API_KEY, max_num_seqs=1, max_num_waiting=2)
    with Stack(config, log_dir=tmp_path_factory.mktemp("logs")) as running:
        yield running


def test_the_api_key_is_in_no_process_command_line(stack: Stack) -> None:
    # /proc/PID/cmdline is readable by every local user; the frontend gets the key in its environment.
    for child in stack.children:
        with open(f"/proc/{child.process.pid}/cmdline", "rb") as cmdline:
            assert API_KEY.encode() not in cmdline.read(), child.name
        with open(f"/proc/{child.process.pid}/environ", "rb") as environ:  # the frontend's alone
            assert (f"CONVEYOR_API_KEY={API_KEY}".encode() in environ.read()) == (child.name == "frontend")
    response = httpx.post(f"{stack.url}/v1/completions", json=completion(max_tokens=2), timeout=30, headers=AUTH)
    assert response.status_code == 200, response.text


def completion(**fields: object) -> dict:
    return {"model": "tiny", "prompt": "Hold the seat", "temperature": 0, "ignore_eos": True, **fields}


def test_v1_routes_answer_401_without_the_api_key_and_health_and_metrics_stay_open(stack: Stack) -> None:
    prompts_before = metric_value(stack.url, "conveyor:prompt_tokens_total")
    refused = [httpx.post(f"{stack.url}/v1/completions", json=completion(max_tokens=2), timeout=30,
                          headers=headers) for headers in ({}, {"Authorization": "Bearer nope"})]
    refused.append(httpx.get(f"{stack.url}/v1/models", timeout=10))
    for response in refused:
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert "API key" in error["message"]
    assert metric_value(stack.url, "conveyor:prompt_tokens_total") == prompts_before  # nothing ran
    accepted = httpx.post(f"{stack.url}/v1/completions", json=completion(max_tokens=2), headers=AUTH,
                          timeout=30)
    assert accepted.status_code == 200, accepted.text
    assert httpx.get(f"{stack.url}/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{stack.url}/metrics", timeout=10).status_code == 200


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """SIGSTOP the process for the block: a paused worker freezes the scheduler inside its step."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def overflow(stack: Stack) -> tuple[list[httpx.Response], list[httpx.Response]]:
    """Fill the one seat and the two waiting places, freeze the engine, send two more requests.
    Returns (the three admitted, the two late ones)."""
    worker = next(child for child in stack.children if child.name == "worker0")
    async with httpx.AsyncClient(base_url=stack.url, headers=AUTH, timeout=60) as client:
        def post(**fields: object) -> asyncio.Task:
            return asyncio.create_task(client.post("/v1/completions", json=completion(**fields)))

        # the first takes the seat; then the n=2 request's two sequences wait (sent together,
        # the n=2 one could arrive first and fill the queue alone, its sibling held behind it)
        admitted = [post(max_tokens=MAX_TOKENS)]
        await wait_until(lambda: metric_value(stack.url, "conveyor:num_requests_running") == 1, 30,
                         "the first request on the seat")
        admitted.append(post(max_tokens=MAX_TOKENS, n=2))
        await wait_until(lambda: metric_value(stack.url, "conveyor:num_requests_waiting") == 2, 30,
                         "two waiting sequences")
        with paused(worker.process.pid):
            late = [post(max_tokens=2), post(max_tokens=2)]
            # at least one is refused at once by the frontend, whose in-flight limit is reached
            await asyncio.wait(late, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        return list(await asyncio.gather(*admitted)), list(await asyncio.gather(*late))


def test_requests_beyond_the_seats_and_the_waiting_queue_get_429_and_the_admitted_ones_complete(
        stack: Stack) -> None:
    admitted, late = asyncio.run(overflow(stack))
    for response in late:
        assert response.status_code == 429, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
        assert "the limit is 3" in error["message"] or "max_num_waiting is 2" in error["message"], error
    assert [response.status_code for response in admitted] == [200, 200]
    assert [len(response.json()["choices"]) for response in admitted] == [1, 2]
    assert [response.json()["usage"]["completion_tokens"] for response in admitted] \
        == [MAX_TOKENS, 2 * MAX_TOKENS]
    assert metric_value(stack.url, "conveyor:num_requests_waiting") == 0
