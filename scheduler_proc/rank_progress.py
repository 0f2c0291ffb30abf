"""Whether an in-flight step's ranks on this node are still computing: their CPU time advances.

A step can be long and healthy (a 2048-token chunk of a prompt near an 8k context takes tens of
seconds on a small CPU) or short and hung; its running time alone cannot tell them apart. What can:
a computing worker's process keeps using CPU, while one that is stopped, blocked for good, or
waiting in a collective on a hung peer does not. A step's idle time is how long it has gone
without every local rank using some CPU; /health reports a stall by it (--stall-timeout), while
--step-timeout still bounds the step's running time whatever it does.
"""

from __future__ import annotations

import os

SAMPLE_INTERVAL_S = 1.0  # how often the ranks' CPU times are read while a step runs
MIN_CPU_SHARE = 0.05  # of each sample interval's wall time, per rank, that counts as computing
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of the process so far (all its threads), or None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime: fields 14 and 15


class RankProgress:
    """One step's progress on this node: `idle_s(now)` is the time since the step started or its
    local ranks (`pids`: rank -> pid) last all used CPU within a sample interval, once a sample
    has found them idle; until then (the step's first interval, or after a sample that found them
    computing) it is 0, so that a --stall-timeout shorter than the interval does not report a
    computing step as stalled between its samples. With no local rank whose CPU time can be read
    (no procfs), a step never shows progress: from its first sample on, its idle time is its
    running time."""

    def __init__(self, pids: dict[int, int], started_s: float) -> None:
        self._pids = dict(pids)
        self._last_progress_s = started_s
        self._sampled_s = started_s
        self._cpu_s = self._read()

    def idle_s(self, now: float) -> float:
        elapsed_s = now - self._sampled_s
        if elapsed_s >= SAMPLE_INTERVAL_S:
            cpu_s = self._read()
            if self._cpu_s and cpu_s.keys() == self._cpu_s.keys() and all(
                    cpu_s[rank] - self._cpu_s[rank] >= MIN_CPU_SHARE * elapsed_s for rank in cpu_s):
                self._last_progress_s = now
            self._cpu_s, self._sampled_s = cpu_s, now
        if self._last_progress_s == self._sampled_s:  # no sample yet, or the last one saw progress
            return 0.0
        return now - self._last_progress_s

    def _read(self) -> dict[int, float]:
        found = {rank: process_cpu_s(pid) for rank, pid in self._pids.items()}
        return {rank: cpu_s for rank, cpu_s in found.items() if cpu_s is not None}
