"""Test-only fault injection, shared by the worker (CONVEYOR_FAULT_INJECTION) and the scheduler
(CONVEYOR_SCHEDULER_FAULT); tests set these variables, nothing else does.

A fault reads `[rank=R,]step=N,action=kill|exit|stall|segv|raise[,once=PATH]` and fires at the
first step whose id is >= N: kill sends its process SIGKILL, exit leaves with code 1, stall blocks
the calling thread for good (SIGKILL is the only way out), segv reads address 0 from native code (a
real segmentation fault, as a bug in the native kernel would make), raise raises InjectedFault (a
Python exception in the step). With once=PATH it fires only if PATH does not exist
yet, and creates it, so the replacement process runs on; without it every replacement fires too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from dataclasses import dataclass

ACTIONS = ("kill", "exit", "stall", "segv", "raise")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault raises."""


@dataclass(frozen=True)
class Fault:
    step: int
    action: str
    once: str = ""
    rank: int = 0

    def fire(self, step_id: int) -> None:
        """Acts when step_id has reached this fault's step (and `once` is still unclaimed)."""
        if step_id < self.step or not _claim(self.once):
            return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "exit":
            os._exit(1)
        elif self.action == "segv":
            ctypes.string_at(0)
        elif self.action == "raise":
            raise InjectedFault(f"injected fault at step {step_id}")
        else:
            threading.Event().wait()


def parse_faults(variable: str, text: str, with_rank: bool) -> list[Fault]:
    """The faults of `variable`'s value, several separated by ';'; `rank=` is required with_rank and
    refused without. ValueError names the variable and the malformed fault."""
    faults = []
    for spec in filter(None, (part.strip() for part in text.split(";"))):
        try:
            fields = dict(item.split("=", 1) for item in spec.split(","))
            rank = int(fields.pop("rank")) if with_rank else 0
            fault = Fault(int(fields.pop("step")), fields.pop("action"), fields.pop("once", ""), rank)
        except (KeyError, ValueError) as error:
            raise ValueError(f"{variable}: cannot read {spec!r}: {error}") from error
        if fields or fault.action not in ACTIONS:
            raise ValueError(f"{variable}: {spec!r} has unknown keys {sorted(fields)} or an action "
                             f"not in {ACTIONS}")
        faults.append(fault)
    return faults


def _claim(once: str) -> bool:
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
