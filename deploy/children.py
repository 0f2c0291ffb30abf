"""A child process of the supervisor, as the launcher plans, starts and describes it."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from typing import IO


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
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        rank = f", tensor-parallel rank {self.rank}" if self.module == "worker_proc" else ""
        return f"{self.name} (pid {self.process.pid}{rank}) {how}"
