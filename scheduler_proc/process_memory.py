"""Resident memory of the scheduler and of its node's worker ranks, for the frontend's metrics.

The frontend exports its own process_* series; the scheduler's and the workers' memory reach it in
SchedulerStats, read from procfs at most once a SAMPLE_INTERVAL_S (a step's outputs cost no read).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SAMPLE_INTERVAL_S = 1.0
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_rss_bytes(pid: int) -> int | None:
    """The process's resident set in bytes, or None when unknown (gone, or no procfs)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return None


class ProcessMemory:
    """`sample()` -> (the scheduler's bytes, its local ranks' bytes summed); 0 where unknown."""

    def __init__(self, local_pids: Callable[[], dict[int, int]]) -> None:
        """`local_pids`: rank -> pid of the worker ranks on this node serving now."""
        self._local_pids = local_pids
        self._sampled_s = -SAMPLE_INTERVAL_S
        self._last = (0, 0)

    def sample(self) -> tuple[int, int]:
        now = time.monotonic()
        if now - self._sampled_s >= SAMPLE_INTERVAL_S:
            workers = [process_rss_bytes(pid) for pid in self._local_pids().values()]
            self._last = (process_rss_bytes(os.getpid()) or 0, sum(filter(None, workers)))
            self._sampled_s = now
        return self._last
