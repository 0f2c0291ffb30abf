"""The scheduler's memory readings: the resident set of a live process, none for a gone one, once a second."""

from __future__ import annotations

import os
import subprocess
import sys

from scheduler_proc.process_memory import ProcessMemory, process_rss_bytes


def test_a_live_process_has_a_resident_set_and_a_gone_one_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_rss_bytes(os.getpid()) > 10 << 20  # this interpreter with numpy and the rest
    assert process_rss_bytes(child.pid) is None


def test_ranks_are_read_at_most_once_an_interval() -> None:
    asked: list[int] = []

    def local_pids() -> dict[int, int]:
        asked.append(1)
        return {0: os.getpid(), 1: os.getpid()}

    memory = ProcessMemory(local_pids)
    scheduler_bytes, workers_bytes = memory.sample()
    assert workers_bytes >= 2 * scheduler_bytes * 0.9  # two "ranks", each this process
    assert memory.sample() == (scheduler_bytes, workers_bytes) and len(asked) == 1
