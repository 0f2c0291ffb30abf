"""A frontend that dies is restarted on the same port by the supervisor; the scheduler aborts the
dead frontend's requests and frees their KV blocks at once (their clients' connections died with
it), and the new frontend serves new requests as the old one did."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
from support import caplog_of, children_of, metric_value, supervised, tiny_config

from deploy.launcher import Child, Stack

PROMPT = "Frontend recovery: the quick brown fox"
NUM_STREAMS = 4


def greedy_text(url: str) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    return response.json()["choices"][0]["text"]


class Stream(threading.Thread):
    """One long streaming request; records how many chunks came and how the stream ended."""

    def __init__(self, url: str, index: int) -> None:
        super().__init__(daemon=True)
        self.url, self.index = url, index
        self.num_chunks = 0
        self.got_done = False
        self.error = ""

    def run(self) -> None:
        body = {"model": "tiny", "prompt": f"{PROMPT} {self.index}", "max_tokens": 480,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    self.num_chunks += line.startswith("data: {")
                    self.got_done = self.got_done or line == "data: [DONE]"
        except httpx.HTTPError as exc:
            self.error = type(exc).__name__


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def health_status(url: str) -> int:
    """/health's status code, 0 while the port refuses connections."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0


def frontend_of(stack: Stack) -> Child:
    return next(child for child in stack.children if child.name == "frontend")


def test_a_killed_frontend_is_restarted_its_requests_aborted_at_once_and_past_the_limit_the_stack_stops(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_model_dir, max_restarts=1)
    with Stack(config, log_dir=tmp_path) as stack, supervised(stack) as reasons, \
            caplog_of("conveyor.deploy") as supervisor_log:
        before = greedy_text(stack.url)
        streams = [Stream(stack.url, index) for index in range(NUM_STREAMS)]
        for stream in streams:
            stream.start()
        wait_for(lambda: all(stream.num_chunks >= 3 for stream in streams), 60, "every stream to run")
        old = frontend_of(stack).process
        old.kill()

        scheduler_log = tmp_path / "scheduler.log"
        aborted = f"the frontend (pid {old.pid}) exited: aborted {NUM_STREAMS} unfinished requests"
        wait_for(lambda: aborted in scheduler_log.read_text(), 2.0, "the scheduler to abort at once")
        wait_for(lambda: health_status(stack.url) == 200, 60, "the new frontend")
        wait_for(lambda: metric_value(stack.url, "conveyor:num_requests_running") == 0
                 and metric_value(stack.url, "conveyor:num_requests_waiting") == 0
                 and metric_value(stack.url, "conveyor:kv_cache_usage_perc") == 0, 5, "an idle engine")
        for stream in streams:
            stream.join(timeout=10)
        assert all(stream.error and not stream.got_done for stream in streams)  # dropped mid-stream

        assert greedy_text(stack.url) == before
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="frontend") == 1
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="worker") == 0
        assert frontend_of(stack).process.pid != old.pid
        assert any(f"frontend (pid {old.pid}) was killed by SIGKILL; restarting the frontend" in line
                   for line in supervisor_log)

        frontend_of(stack).process.kill()  # a second fault: more than --max-restarts 1
        wait_for(lambda: reasons, 30, "the supervisor to stop the stack")
        pids = [child.process.pid for child in stack.children]
    assert "frontend" in reasons[0] and "was killed by SIGKILL" in reasons[0]
    assert "--max-restarts 1" in reasons[0] and reasons[0].count("killed by SIGKILL") == 2
    assert not [pid for pid in children_of(os.getpid()) if pid in pids]


def test_a_restarted_frontend_that_hangs_while_starting_is_killed_after_ready_timeout_and_restarted(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_model_dir, max_restarts=3, ready_timeout_s=20.0)
    with Stack(config, log_dir=tmp_path) as stack, supervised(stack) as reasons, \
            caplog_of("conveyor.deploy") as supervisor_log:
        first = frontend_of(stack).process
        first.kill()
        wait_for(lambda: frontend_of(stack).process.pid != first.pid, 10, "a restarted frontend")
        hung = frontend_of(stack).process
        hung.send_signal(signal.SIGSTOP)  # long before it can import its way to ready
        wait_for(lambda: frontend_of(stack).process.pid not in (first.pid, hung.pid), 30,
                 "the hung frontend to be replaced")
        wait_for(lambda: health_status(stack.url) == 200, 60, "the third frontend")
        assert not reasons
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="frontend") == 2
    assert any(f"frontend (pid {hung.pid}) is not ready 20 s after its restart (--ready-timeout)" in line
               for line in supervisor_log)
    assert any(f"frontend (pid {hung.pid}) was killed by SIGKILL after it was not ready 20 s" in line for line in supervisor_log)


def restart_counts(url: str) -> dict[str, float]:
    return {kind: metric_value(url, "conveyor:process_restarts_total", process=kind)
            for kind in ("frontend", "scheduler", "worker")}


def test_a_restarted_frontend_continues_every_process_restart_count(tiny_model_dir: Path, tmp_path: Path) -> None:
    with Stack(tiny_config(tiny_model_dir, max_restarts=5), log_dir=tmp_path) as stack, supervised(stack) as reasons:
        for module, kind in (("worker_proc", "worker"), ("scheduler_proc", "scheduler")):
            next(c for c in stack.children if c.module == module).process.kill()
            wait_for(lambda: health_status(stack.url) == 200 and restart_counts(stack.url)[kind] == 1, 60,
                     f"the {kind} replaced")
        first = frontend_of(stack).process
        first.kill()
        wait_for(lambda: frontend_of(stack).process.pid != first.pid and health_status(stack.url) == 200, 60,
                 "a restarted frontend")
        greedy_text(stack.url)  # a step after the restart: the scheduler's running totals arrive
        assert restart_counts(stack.url) == {"frontend": 1, "scheduler": 1, "worker": 1}
        assert not reasons
