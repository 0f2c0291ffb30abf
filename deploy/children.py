"""A child process of the supervisor, as the launcher plans, starts and describes it."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from typing import IO

from proto.processes import PidFds


class StartupError(RuntimeError):
    """A process did not become ready; the message names it and says why."""


@dataclass
class Child:
    name: str
    module: str
    extra_args: list[str]
    env: dict[str, str] = field(default_factory=dict)  # overrides, e.g. a worker's one GPU
    process: subprocess.Popen | None = None
    log_file: IO[bytes] | None = None

    @property
    def rank(self) -> int:
        """A worker's tensor-parallel rank (-1 for the other processes)."""
        return int(self.extra_args[1]) if self.module == "worker_proc" else -1

    def describe_exit(self) -> str:
        code = self.process.returncode
        how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
        rank = f", tensor-parallel rank {self.rank}" if self.module == "worker_proc" else ""
        return f"{self.name} (pid {self.process.pid}{rank}) {how}"


def _signal_name(number: int) -> str:
    """SIGKILL, or SIGRTMIN+3 / signal 64 for those the signal module has no name for."""
    try:
        return signal.Signals(number).name
    except ValueError:
        rtmin = getattr(signal, "SIGRTMIN", None)
        return f"SIGRTMIN+{number - rtmin}" if rtmin is not None and number >= rtmin else f"signal {number}"


class ExitWatch:
    """File descriptors that turn readable when a child exits (PidFds), so that the supervisor's
    wait on its sockets ends at a death instead of at its next poll. Only children still running
    are watched, so a dead one cannot keep waking the wait."""

    def __init__(self) -> None:
        self._pidfds = PidFds()

    def fds(self, children: list[Child]) -> list[int]:
        running = {child.process.pid for child in children
                   if child.process is not None and child.process.poll() is None}
        return list(self._pidfds.fds(running).values())

    def close(self) -> None:
        self._pidfds.close()
