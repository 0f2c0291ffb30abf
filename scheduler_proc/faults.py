"""Fault injection for the scheduler recovery tests, read from CONVEYOR_SCHEDULER_FAULT (tests set
it; nothing else does): `step=N,action=kill|exit|stall[,once=PATH]`. The scheduler fires before
it sends the first plan whose step id is >= N: kill sends itself SIGKILL, exit leaves with code 1,
stall stops its loop for good (no step, no heartbeat) until it is killed. With once=PATH it fires
only if PATH does not exist yet and creates it, so the replacement scheduler runs on."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

VARIABLE = "CONVEYOR_SCHEDULER_FAULT"
ACTIONS = ("kill", "exit", "stall")


@dataclass(frozen=True)
class SchedulerFault:
    step: int
    action: str
    once: str = ""

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> SchedulerFault | None:
        """The fault CONVEYOR_SCHEDULER_FAULT names, or None; ValueError names a malformed one."""
        text = (os.environ if environ is None else environ).get(VARIABLE, "").strip()
        if not text:
            return None
        try:
            fields = dict(item.split("=", 1) for item in text.split(","))
            fault = cls(int(fields.pop("step")), fields.pop("action"), fields.pop("once", ""))
        except (KeyError, ValueError) as error:
            raise ValueError(f"{VARIABLE}: cannot read {text!r}: {error}") from error
        if fields or fault.action not in ACTIONS:
            raise ValueError(f"{VARIABLE}: {text!r} has unknown keys {sorted(fields)} or an action "
                             f"not in {ACTIONS}")
        return fault

    def fire(self, step_id: int) -> None:
        if step_id >= self.step and _claim(self.once):
            if self.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.action == "exit":
                os._exit(1)
            else:
                threading.Event().wait()  # stall: SIGKILL is the only way out


def _claim(once: str) -> bool:
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
