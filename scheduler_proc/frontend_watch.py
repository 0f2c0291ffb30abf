"""Which frontend process the scheduler serves, and whether that process still lives."""

from __future__ import annotations

import time
from collections.abc import Callable

FRONTEND_CHECK_INTERVAL_S = 0.25  # how often the frontend's process is looked at (one /proc read)


class FrontendWatch:
    """The frontend that said hello last (FrontendHello.pid). The frontend always runs on the
    scheduler's node, so its process can be looked at directly: once per `interval_s`, so a loop
    that asks every step pays a clock read. Before any hello nothing is watched (a test's
    stand-in frontend never says hello)."""

    def __init__(self, process_alive: Callable[[int], bool],
                 interval_s: float = FRONTEND_CHECK_INTERVAL_S) -> None:
        self._process_alive = process_alive
        self._interval_s = interval_s
        self.pid: int | None = None
        self._alive = True  # False once the watched process has exited, until the next hello
        self._checked_s = 0.0  # time.monotonic() of the last look

    def greet(self, pid: int) -> int | None:
        """Watch pid from now on. Returns the frontend watched until now if its process has exited
        (a replacement can say hello before the next look), else None."""
        old = self.pid
        gone = old if old is not None and old != pid and not self._process_alive(old) else None
        self.pid, self._alive, self._checked_s = pid, True, time.monotonic()
        return gone

    def exited(self) -> bool:
        """The watched frontend has exited (also true after take_exited, until the next hello:
        nobody reads outputs meanwhile)."""
        now_s = time.monotonic()
        if self.pid is not None and now_s - self._checked_s >= self._interval_s:
            self._checked_s = now_s
            self._alive = self._process_alive(self.pid)
        return not self._alive

    def take_exited(self) -> int | None:
        """The pid of the watched frontend if it has exited, once; it is then no longer watched."""
        if self.pid is None or not self.exited():
            return None
        pid, self.pid = self.pid, None
        return pid
