"""A step's ranks count as computing while their processes use CPU; a stopped or blocked one does not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from scheduler_proc.rank_progress import SAMPLE_INTERVAL_S, RankProgress, process_cpu_s

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/stat"), reason="needs procfs")


def child(code: str) -> subprocess.Popen:
    """A process running `code` once it has started (its start-up's own CPU time is behind it)."""
    process = subprocess.Popen([sys.executable, "-c", f"print('up', flush=True)\n{code}"],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "up\n"
    return process


def test_a_busy_rank_keeps_the_step_progressing_and_a_blocked_one_makes_it_idle() -> None:
    busy, blocked = child("while True: pass"), child("import threading; threading.Event().wait()")
    try:
        started_s = time.monotonic()
        alone, together = RankProgress({0: busy.pid}, started_s), RankProgress({0: busy.pid, 1: blocked.pid}, started_s)
        idle = RankProgress({0: blocked.pid}, started_s)
        time.sleep(SAMPLE_INTERVAL_S + 0.2)
        now = time.monotonic()
        assert alone.idle_s(now) == 0.0
        assert together.idle_s(now) == pytest.approx(now - started_s)  # every local rank must compute
        assert idle.idle_s(now) == pytest.approx(now - started_s)
        assert idle.idle_s(now + 0.5) == pytest.approx(now + 0.5 - started_s)  # between samples: it grows
    finally:
        for process in (busy, blocked):
            process.kill()
            process.wait()


def test_without_a_readable_rank_the_idle_time_is_the_running_time() -> None:
    assert process_cpu_s(2 ** 22 + 7) is None  # beyond any pid_max: no such process
    progress = RankProgress({0: 2 ** 22 + 7}, 100.0)
    assert progress.idle_s(100.5) == 0.0  # no sample yet
    assert progress.idle_s(103.0) == 3.0 and progress.idle_s(103.5) == 3.5
    assert RankProgress({}, 100.0).idle_s(112.0) == 12.0


def test_a_computing_step_reads_idle_at_no_time_so_a_short_stall_timeout_does_not_flap() -> None:
    """Before its first sample, and between samples after one that saw every rank compute, a step's
    idle time is 0: with --stall-timeout under the sample interval, /health would otherwise turn
    'stalled' in every interval of a healthy step."""
    busy = child("while True: pass")
    try:
        started_s = time.monotonic()
        progress = RankProgress({0: busy.pid}, started_s)
        assert progress.idle_s(started_s + 0.9 * SAMPLE_INTERVAL_S) == 0.0
        time.sleep(SAMPLE_INTERVAL_S + 0.2)
        now = time.monotonic()
        assert progress.idle_s(now) == 0.0
        assert progress.idle_s(now + 0.9 * SAMPLE_INTERVAL_S) == 0.0
    finally:
        busy.kill()
        busy.wait()
