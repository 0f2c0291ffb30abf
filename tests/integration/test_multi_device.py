"""Tensor-parallel ranks in the served stack (gloo on the CPU): same text, one supervisor per node
over CURVE step channels that peers without the key cannot enter, and a lost rank replaces its
group, named in the supervisor's log, while /health says 503."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq
import zmq.auth
from support import (caplog_of, children_of, free_port, free_port_block, hf_greedy_texts, metric_value,
                     sse_events, supervised, tiny_config)

from deploy.launcher import Child, Stack
from proto import codec, sockets
from proto.messages import StepResult
from proto.processes import process_alive

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


@pytest.mark.ranks(2)
def test_two_tensor_parallel_ranks_serve_the_greedy_text_of_one(
        tiny_model_dir: Path, hf_texts: list[str], tmp_path: Path) -> None:
    with Stack(tiny_config(tiny_model_dir, tensor_parallel_size=2), log_dir=tmp_path) as stack:
        assert [c.name for c in stack.children] == ["scheduler", "worker0", "worker1", "frontend"]
        assert greedy_texts(stack.url) == hf_texts  # HF's text is what one rank serves


@pytest.mark.ranks(2)
def test_killing_one_rank_replaces_the_group_naming_it_and_health_is_503_until_it_serves(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    with Stack(tiny_config(tiny_model_dir, tensor_parallel_size=2), log_dir=tmp_path) as stack:
        with supervised(stack), caplog_of("conveyor.deploy") as records:
            old = [worker(stack, rank).process.pid for rank in (0, 1)]
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 60, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as stream:
                lines = stream.iter_lines()  # kept: a dropped iterator would close the stream
                first = next(lines)  # a request is in flight when the rank dies
                probe = HealthProbe(stack.url)
                while not probe.codes:  # its first answer comes before the kill (seen within ms)
                    time.sleep(0.005)
                worker(stack, 1).process.kill()
                events = sse_events([first, *lines])
            time.sleep(1.5)  # the probe sees serving again
            new = [worker(stack, rank).process.pid for rank in (0, 1)]
            undisturbed = httpx.post(f"{stack.url}/v1/completions", json={**body, "stream": False},
                                     timeout=60).json()["choices"][0]["text"]
    probe.join(timeout=60)
    chunks = [event for event in events[:-1] if event["choices"]]
    assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == undisturbed  # nothing lost or repeated
    log = "\n".join(records)
    assert "worker1" in log and "tensor-parallel rank 1" in log and "SIGKILL" in log
    assert probe.codes[:3] == [200, 503, 200], probe.codes
    assert not any(process_alive(pid) for pid in old) and not set(new) & set(old)


@pytest.mark.ranks(2)
def test_a_rank_that_does_not_answer_a_step_is_killed_and_replaced_naming_it(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # Longer than the frontend's 5 s alive timeout: /health turns 503 while the step hangs.
    config = tiny_config(tiny_model_dir, tensor_parallel_size=2, step_timeout_s=7.0)
    with Stack(config, log_dir=tmp_path) as stack:
        with supervised(stack), caplog_of("conveyor.deploy") as records:
            stuck = worker(stack, 1).process
            probe = HealthProbe(stack.url)
            os.kill(stuck.pid, signal.SIGSTOP)  # the supervisor's SIGKILL still ends it
            response = httpx.post(f"{stack.url}/v1/completions", timeout=60,
                                  json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                        "temperature": 0, "ignore_eos": True})
            time.sleep(1.5)
    probe.join(timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    log = "\n".join(records)
    assert "worker1" in log and "is given up by the scheduler: worker rank 1 did not answer step" in log, log
    assert "--step-timeout" in log and "after the scheduler gave it up" in log
    assert probe.codes[:3] == [200, 503, 200], probe.codes
    assert not process_alive(stuck.pid)


def two_node_argv(model_dir: Path, master_port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deploy.cli", "serve", str(model_dir), "--dtype", "float32",
            "--served-model-name", "tiny", "--num-kv-blocks", "64", "--num-threads", "1",
            "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(master_port), "--shutdown-timeout", "5", "--log-level", "warning", *extra]


@pytest.mark.cpu_workers
def test_two_supervisors_on_loopback_serve_as_two_nodes_and_peers_without_the_key_get_nothing_through(
        tiny_model_dir: Path, hf_texts: list[str], tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    keygen = subprocess.run([sys.executable, "-m", "deploy.cli", "keygen", str(keys_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert keygen.returncode == 0, keygen.stderr
    http_port, master_port = free_port(), free_port_block(5)
    common = two_node_argv(tiny_model_dir, master_port, "--transport-keys", str(keys_dir))
    node0_log = tmp_path / "node0.log"
    with open(node0_log, "wb") as node0_output:
        nodes = [subprocess.Popen([*common, "--node-rank", "1"], cwd=ROOT),
                 subprocess.Popen([*common, "--node-rank", "0", "--port", str(http_port)], cwd=ROOT,
                                  stderr=node0_output)]
    context, children = zmq.Context(), []
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_healthy(url, nodes)
        children = [pid for node in nodes for pid in children_of(node.pid)]
        assert len(children) == 4  # node 1: worker1; node 0: scheduler, worker0, frontend
        # Intruders on every step port, plain and CURVE; on the plan ports they would take plans.
        public_key, _ = zmq.auth.load_certificate(keys_dir / "conveyor.key")
        senders = [intruder(context, zmq.PUSH, master_port + 1, server_key)
                   for server_key in (None, public_key)]
        for sender in senders:
            sender.send(b"\xc1 garbage")
            sender.send(codec.encode(StepResult(0, np.zeros(0, np.int32), "", rank=1)))
        thieves = [intruder(context, zmq.PULL, master_port + 2 + rank, server_key)
                   for rank in (0, 1) for server_key in (None, public_key)]
        wait_for_text(node0_log, "refused a step-channel peer", count=3)  # the CURVE ones, by ZAP
        assert greedy_texts(url) == hf_texts
        assert all(sockets.recv_ready(thief, 0.05) is None for thief in thieves)
        assert metric_value(url, "conveyor:protocol_errors_total") == 0  # no intruder frame was read
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)
            assert node.wait(timeout=60) == 0
    finally:
        context.destroy(linger=0)
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert not any(process_alive(pid) for pid in children)


@pytest.mark.cpu_workers
def test_two_nodes_without_keys_refuse_to_start_naming_the_flags(tiny_model_dir: Path) -> None:
    result = subprocess.run(two_node_argv(tiny_model_dir, free_port_block(5), "--node-rank", "1"),
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--transport-keys DIR" in result.stderr and "conveyor keygen DIR" in result.stderr
    assert "--insecure-transport" in result.stderr


def intruder(context: zmq.Context, kind: int, port: int, server_key: bytes | None) -> zmq.Socket:
    """A peer without the deployment's secret key: plain ZMTP, or (given the deployment's public
    key) CURVE with a key pair of its own."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server_key
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def wait_for_text(path: Path, text: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while path.read_text(errors="replace").count(text) < count:
        assert time.monotonic() < deadline, f"{path} does not say {text!r} {count} times"
        time.sleep(0.1)


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

