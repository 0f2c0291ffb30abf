"""The worker process over real ZMQ: handshake, steps, bad frames, start-up failure, parent death."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from worker_plans import BlockPool, Seq, make_plan, tiny_engine_config

from proto import codec, sockets
from proto.config import EngineConfig
from proto.control import ProcessFailed, ProcessReady
from proto.messages import MESSAGE_TYPES, StepResult, WorkerReady

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0


class SchedulerSide:
    """The sockets the scheduler and supervisor bind, seen from a test."""

    def __init__(self, runtime_dir: str) -> None:
        self.context = zmq.Context()
        self.plans = sockets.bind(self.context, zmq.PUSH, runtime_dir, sockets.plan_channel(0))
        self.results = sockets.bind(self.context, zmq.PULL, runtime_dir, sockets.RESULTS)
        self.control = sockets.bind(self.context, zmq.PULL, runtime_dir, sockets.CONTROL)

    def receive(self, sock: zmq.Socket) -> object:
        frame = sockets.recv_ready(sock, TIMEOUT_S)
        assert frame is not None, "the worker sent nothing in time"
        return codec.decode(frame, MESSAGE_TYPES)  # results and control frames alike


@pytest.fixture
def scheduler_side() -> Iterator[tuple[SchedulerSide, str]]:
    runtime_dir = sockets.make_runtime_dir()
    side = SchedulerSide(runtime_dir)
    yield side, runtime_dir
    side.context.destroy(linger=0)
    shutil.rmtree(runtime_dir, ignore_errors=True)


def worker_argv(config: EngineConfig) -> list[str]:
    return [sys.executable, "-m", "worker_proc", "--config", config.to_json(), "--rank", "0"]


def test_worker_handshakes_then_answers_plans_and_survives_bad_frames(
        scheduler_side: tuple[SchedulerSide, str], tiny_model_dir: Path) -> None:
    side, runtime_dir = scheduler_side
    config = tiny_engine_config(tiny_model_dir, runtime_dir=runtime_dir, num_threads=1)
    proc = subprocess.Popen(worker_argv(config), cwd=ROOT)
    try:
        assert side.receive(side.results) == WorkerReady(rank=0, num_kv_blocks=64, pid=proc.pid, dtype="float32",
                                                         kv_cache_dtype="float32")
        ready = side.receive(side.control)
        assert isinstance(ready, ProcessReady) and ready.name == "worker0" and ready.pid == proc.pid
        side.plans.send(b"\x93not a message")
        sockets.send(side.plans, WorkerReady(rank=0, num_kv_blocks=1, pid=1))  # valid, wrong kind
        seq = Seq("a", [5, 6, 7])
        sockets.send(side.plans, make_plan([seq], [3], BlockPool(64, block_size=4), step_id=7))
        result = side.receive(side.results)
        assert isinstance(result, StepResult) and result.step_id == 7 and result.error == ""
        assert result.sampled_token_ids.shape == (1,)
        too_few_blocks = make_plan([Seq("b", [1] * 9, block_ids=[0])], [9], BlockPool(0, 16), step_id=8)
        sockets.send(side.plans, too_few_blocks)
        failed = side.receive(side.results)
        assert failed.step_id == 8 and len(failed.sampled_token_ids) == 0 and "KV blocks" in failed.error
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S) == 0
    finally:
        proc.kill()


def test_worker_that_cannot_load_its_model_reports_process_failed(
        scheduler_side: tuple[SchedulerSide, str], tmp_path: Path) -> None:
    side, runtime_dir = scheduler_side
    config = tiny_engine_config(tmp_path / "no-such-model", runtime_dir=runtime_dir)
    proc = subprocess.Popen(worker_argv(config), cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        failed = side.receive(side.control)
        assert isinstance(failed, ProcessFailed) and failed.name == "worker0"
        assert "no config.json" in failed.message and "no-such-model" in failed.message
        assert proc.wait(timeout=TIMEOUT_S) == 1
    finally:
        proc.kill()


def test_worker_exits_when_its_parent_dies(scheduler_side: tuple[SchedulerSide, str],
                                           tiny_model_dir: Path) -> None:
    side, runtime_dir = scheduler_side
    config = tiny_engine_config(tiny_model_dir, runtime_dir=runtime_dir, num_threads=1)
    parent_code = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", parent_code, *worker_argv(config)], cwd=ROOT)
    try:
        worker_pid = side.receive(side.results).pid
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _is_running(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _is_running(worker_pid), "the orphaned worker kept running"
    finally:
        parent.kill()


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
