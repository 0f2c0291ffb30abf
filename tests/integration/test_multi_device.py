"""Tensor-parallel ranks in the served stack (gloo on the CPU): same text, one supervisor per node,
and a lost rank stops everything with an error that names it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import children_of, free_port, hf_greedy_texts, process_alive, tiny_config

from deploy.launcher import Child, Stack

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "Paged attention stores keys", "What is the capital of France?"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def hf_texts(tiny_model_dir: Path) -> list[str]:
    return hf_greedy_texts(tiny_model_dir, PROMPTS, MAX_TOKENS)


def greedy_texts(base_url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def worker(stack: Stack, rank: int) -> Child:
    return next(c for c in stack.children if c.name == f"worker{rank}")


class HealthProbe(threading.Thread):
    """Polls /health until the server stops answering; `codes` is what it saw, in order."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.codes = base_url, []
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                code = httpx.get(f"{self.base_url}/health", timeout=2).status_code
            except httpx.HTTPError:
                return
            if not self.codes or self.codes[-1] != code:
                self.codes.append(code)
            time.sleep(0.01)


def test_two_tensor_parallel_ranks_serve_the_greedy_text_of_one(
        tiny_model_dir: Path, hf_texts: list[str], tmp_path: Path) -> None:
    with Stack(tiny_config(tiny_model_dir, tensor_parallel_size=2), log_dir=tmp_path) as stack:
        assert [c.name for c in stack.children] == ["scheduler", "worker0", "worker1", "frontend"]
        assert greedy_texts(stack.url) == hf_texts  # HF's text is what one rank serves


def test_killing_one_rank_stops_the_stack_naming_it_and_health_turns_503_first(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    with Stack(tiny_config(tiny_model_dir, tensor_parallel_size=2), log_dir=tmp_path) as stack:
        pids = [child.process.pid for child in stack.children]
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator would close the stream
            next(lines)  # a request is in flight when the rank dies
            probe = HealthProbe(stack.url)
            worker(stack, 1).process.kill()
            reason = stack.watch(lambda: False, poll_s=0.1)
            stack.stop()  # with the request still in flight: the frontend drains it, at 503
            assert "the scheduler is shutting down" in "".join(lines)  # it ended, with an error
    probe.join(timeout=60)
    assert "worker1" in reason and "tensor-parallel rank 1" in reason and "SIGKILL" in reason
    assert probe.codes[0] == 200 and probe.codes[-1] == 503, probe.codes
    assert not any(process_alive(pid) for pid in pids)


def test_a_rank_that_does_not_answer_a_step_stops_the_stack_naming_it(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # Longer than the frontend's 5 s alive timeout: /health turns 503 while the step hangs.
    config = tiny_config(tiny_model_dir, tensor_parallel_size=2, step_timeout_s=7.0)
    with Stack(config, log_dir=tmp_path) as stack:
        pids = [child.process.pid for child in stack.children]
        stuck = worker(stack, 1).process
        probe = HealthProbe(stack.url)
        os.kill(stuck.pid, signal.SIGSTOP)
        try:
            response = httpx.post(f"{stack.url}/v1/completions", timeout=60,
                                  json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
            reason = stack.watch(lambda: False, poll_s=0.1)
        finally:
            os.kill(stuck.pid, signal.SIGCONT)
    probe.join(timeout=60)
    assert response.status_code != 200 and "worker rank 1 did not answer step" in response.text
    assert "scheduler" in reason and "worker rank 1 did not answer step" in reason, reason
    assert probe.codes == [200, 503]
    assert not any(process_alive(pid) for pid in pids)


def free_port_block(size: int) -> int:
    """A base port with `size` free ports after it (torch.distributed + the step channels)."""
    for _ in range(50):
        base = free_port()
        if base + size > 65535:
            continue
        try:
            for port in range(base, base + size):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no block of {size} free ports")


def test_two_supervisors_on_loopback_serve_as_two_nodes(tiny_model_dir: Path,
                                                        hf_texts: list[str]) -> None:
    http_port, master_port = free_port(), free_port_block(4)
    common = [sys.executable, "-m", "deploy.cli", "serve", str(tiny_model_dir), "--dtype", "float32",
              "--served-model-name", "tiny", "--num-kv-blocks", "64", "--num-threads", "1",
              "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(master_port), "--shutdown-timeout", "5", "--log-level", "warning"]
    nodes = [subprocess.Popen([*common, "--node-rank", "1"], cwd=ROOT),
             subprocess.Popen([*common, "--node-rank", "0", "--port", str(http_port)], cwd=ROOT)]
    children: list[int] = []
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_healthy(url, nodes)
        children = [pid for node in nodes for pid in children_of(node.pid)]
        assert len(children) == 4  # node 1: worker1; node 0: scheduler, worker0, frontend
        assert greedy_texts(url) == hf_texts
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)
            assert node.wait(timeout=60) == 0
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert not any(process_alive(pid) for pid in children)


def wait_healthy(url: str, nodes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert all(node.poll() is None for node in nodes), "a supervisor exited during start-up"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("the two-node stack did not become healthy")

