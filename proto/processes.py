"""Whether a process on this node still runs: the scheduler watches its local worker ranks and
its frontend this way, and the frontend its scheduler (all of them run on node 0). PidFds wake a
poll at a death (the supervisor's children, the scheduler's local ranks)."""

from __future__ import annotations

import os
from collections.abc import Iterable


def process_alive(pid: int) -> bool:
    """False once the process has exited (a zombie its parent has not reaped yet included)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class PidFds:
    """Linux pidfds of processes, each readable once its process has exited, so that a poll on
    sockets ends at a death instead of at its timeout. Where pidfds do not exist (not Linux, a
    kernel before 5.3) or a process is gone already, none is kept for it: deaths then wait for the
    caller's next look (process_alive)."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}  # pid -> pidfd

    def fds(self, pids: Iterable[int]) -> dict[int, int]:
        """pid -> pidfd for those of pids that have one (opened at the first ask); the pidfds of
        pids not asked for any more are closed."""
        wanted = set(pids)
        for pid in set(self._fds) - wanted:
            os.close(self._fds.pop(pid))
        for pid in wanted - set(self._fds):
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except (AttributeError, OSError):  # no pidfds here, or the process is gone already
                pass
        return dict(self._fds)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
