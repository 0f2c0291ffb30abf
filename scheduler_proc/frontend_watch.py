"""Which frontend process the scheduler serves, whether that process still lives, and the abort
of a lost frontend's requests."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_proc.engine import SchedulerEngine

logger = logging.getLogger(__name__)

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

    def greet_and_abort_earlier(self, pid: int, engine: SchedulerEngine) -> None:
        """A frontend (re)started. Its hello comes before its requests on its one connection, so
        whatever is unfinished now came from an earlier frontend: a second line behind
        abort_if_exited, which aborts a dead frontend's requests without waiting for the next one."""
        logger.info("frontend pid %d connected", pid)
        gone = self.greet(pid)
        abort_lost_requests(engine, f"the frontend (pid {gone}) exited" if gone is not None
                            else f"a new frontend (pid {pid}) connected")

    def abort_if_exited(self, engine: SchedulerEngine) -> None:
        """A frontend that died (SIGKILL, crash) took its clients' connections with it: abort its
        requests now (looked at every interval_s), not when the supervisor's new one starts."""
        pid = self.take_exited()
        if pid is not None:
            abort_lost_requests(engine, f"the frontend (pid {pid}) exited")


def abort_lost_requests(engine: SchedulerEngine, why: str) -> None:
    """Abort every unfinished request, freeing seats and KV blocks now. Their terminal outputs are
    dropped: no living frontend knows their ids."""
    num_aborted = engine.abort_all()
    if num_aborted:
        logger.warning("%s: aborted %d unfinished requests (their clients are gone)", why, num_aborted)
    if engine.drain_outputs() is not None:
        logger.debug("dropped the terminal outputs of requests with no frontend")
