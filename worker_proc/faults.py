"""Fault injection for the worker recovery tests (proto.faults), read from
CONVEYOR_FAULT_INJECTION: `rank=R,step=N,action=kill|exit|stall|segv|raise[,once=PATH]`, several
separated by ';'. Rank R fires as it starts the first plan whose step id is >= N, inside the step
(a raise is the step's own exception); stall never answers."""

from __future__ import annotations

import os

from proto.faults import parse_faults

VARIABLE = "CONVEYOR_FAULT_INJECTION"


class FaultInjector:
    """This rank's faults; fire(step_id) before each step."""

    def __init__(self, rank: int, environ: dict[str, str] | None = None) -> None:
        text = (os.environ if environ is None else environ).get(VARIABLE, "")
        self.faults = [fault for fault in parse_faults(VARIABLE, text, with_rank=True) if fault.rank == rank]

    def fire(self, step_id: int) -> None:
        for fault in self.faults:
            fault.fire(step_id)
