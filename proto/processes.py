"""Whether a process on this node still runs: the scheduler watches its local worker ranks and
its frontend this way, and the frontend its scheduler (all of them run on node 0)."""

from __future__ import annotations

import os


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
