"""Fault injection for recovery tests, read from CONVEYOR_FAULT_INJECTION (tests set it; nothing
else does): `rank=R,step=N,action=kill|exit|stall[,once=PATH]`, several separated by ';'. Rank R
fires at the first plan whose step id is >= N: kill sends itself SIGKILL, exit leaves with code 1,
stall never answers (until killed). With once=PATH it fires only if PATH does not exist yet and
creates it, so the replacement worker runs on; without it every replacement fires too."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

VARIABLE = "CONVEYOR_FAULT_INJECTION"
ACTIONS = ("kill", "exit", "stall")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    action: str
    once: str = ""


def parse_faults(text: str) -> list[Fault]:
    """The faults of a CONVEYOR_FAULT_INJECTION value; ValueError names a malformed one."""
    faults = []
    for spec in filter(None, (part.strip() for part in text.split(";"))):
        try:
            fields = dict(item.split("=", 1) for item in spec.split(","))
            fault = Fault(int(fields.pop("rank")), int(fields.pop("step")), fields.pop("action"),
                          fields.pop("once", ""))
        except (KeyError, ValueError) as error:
            raise ValueError(f"{VARIABLE}: cannot read {spec!r}: {error}") from error
        if fields or fault.action not in ACTIONS:
            raise ValueError(f"{VARIABLE}: {spec!r} has unknown keys {sorted(fields)} or an action "
                             f"not in {ACTIONS}")
        faults.append(fault)
    return faults


class FaultInjector:
    """This rank's faults; fire(step_id) before each step."""

    def __init__(self, rank: int, environ: dict[str, str] | None = None) -> None:
        text = (os.environ if environ is None else environ).get(VARIABLE, "")
        self.faults = [fault for fault in parse_faults(text) if fault.rank == rank]

    def fire(self, step_id: int) -> None:
        for fault in self.faults:
            if step_id >= fault.step and _claim(fault.once):
                _act(fault.action)


def _claim(once: str) -> bool:
    if not once:
        return True
    try:
        os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _act(action: str) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "exit":
        os._exit(1)
    else:
        threading.Event().wait()  # stall: SIGKILL is the only way out
