"""How often the supervisor may replace a lost process (a worker group, the frontend or the
scheduler, one budget for all): at most max_restarts within a sliding window of restart_window_s;
the next fault stops the stack, naming the last causes."""

from __future__ import annotations

import time
from collections import deque


class RestartBudget:
    """Restart times and causes within the window (time.monotonic())."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._recent: deque[tuple[float, str]] = deque()
        self.num_restarts_total = 0

    def allow(self, cause: str, now_s: float | None = None) -> bool:
        """Record a restart for `cause` and return True, or False when the window is full."""
        now_s = time.monotonic() if now_s is None else now_s
        while self._recent and now_s - self._recent[0][0] > self.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            return False
        self._recent.append((now_s, cause))
        self.num_restarts_total += 1
        return True

    def describe(self) -> str:
        """Where the budget stands after the latest allow(), for the restart's log line."""
        return (f"restart {len(self._recent)} of at most {self.max_restarts} within {self.window_s:.0f} s, "
                f"{self.num_restarts_total} in all")

    def exhausted(self, cause: str) -> str:
        """Why the stack stops: this cause and the ones restarted for within the window."""
        earlier = "; ".join(recent_cause for _, recent_cause in self._recent) or "none"
        return (f"{cause}; that is more than --max-restarts {self.max_restarts} restarts within "
                f"{self.window_s:.0f} s (--restart-window); earlier causes: {earlier}")
