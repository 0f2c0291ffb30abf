"""Exclusive wall time per category for nested calls: a call's time minus the time of the timed
calls inside it, so the categories of one step add up to the step."""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class Stopwatch:
    """wrap(fn, category) returns fn timed into category. The worker computes synchronously on the
    CPU, so wall time around a call is that call's compute."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # per open call: time spent in timed calls inside it

    def wrap(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                inner = self._stack.pop()
                self.seconds[category] += elapsed - inner
                if self._stack:
                    self._stack[-1] += elapsed
        return timed

    def take(self) -> dict[str, float]:
        """Seconds per category since the last take, and reset."""
        taken, self.seconds = dict(self.seconds), defaultdict(float)
        return taken
