"""The supervisor's wait wakes at a child's exit (a pidfd per running child), and a dead child
stops being watched, so it cannot keep waking the wait."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from deploy.children import Child, ExitWatch

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfds on this platform")


def readable_within(fds: list[int], timeout_s: float) -> bool:
    poller = zmq.Poller()
    for fd in fds:
        poller.register(fd, zmq.POLLIN)
    return bool(poller.poll(int(timeout_s * 1000)))


def test_an_exit_wakes_the_wait_and_the_dead_child_is_dropped() -> None:
    child = Child("worker0", "worker_proc", ["--rank", "0"])
    child.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = ExitWatch()
    try:
        fds = watch.fds([child])
        assert len(fds) == 1 and not readable_within(fds, 0.2)
        child.process.kill()
        started = time.monotonic()
        assert readable_within(fds, 5.0) and time.monotonic() - started < 1.0
        child.process.wait()
        assert watch.fds([child]) == []  # reaped: no longer watched, its descriptor closed
        with pytest.raises(OSError):
            os.fstat(fds[0])
    finally:
        if child.process.poll() is None:
            child.process.kill()
        watch.close()


def test_a_replaced_child_is_watched_under_its_new_pid() -> None:
    child = Child("frontend", "frontend", [])
    watch = ExitWatch()
    try:
        child.process = subprocess.Popen([sys.executable, "-c", "pass"])
        child.process.wait()
        assert watch.fds([child]) == []  # already exited: nothing to watch
        child.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        assert len(watch.fds([child])) == 1
    finally:
        child.process.kill()
        child.process.wait()
        watch.close()


@pytest.mark.parametrize("signal_number, name", [(9, "SIGKILL"), (37, "SIGRTMIN+3")])
def test_a_child_killed_by_any_signal_is_described_by_the_signals_name(signal_number: int, name: str) -> None:
    child = Child("worker1", "worker_proc", ["--rank", "1"])
    child.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(child.process.pid, signal_number)
    child.process.wait(10)
    assert child.describe_exit() == f"worker1 (pid {child.process.pid}, tensor-parallel rank 1) was killed by {name}"
