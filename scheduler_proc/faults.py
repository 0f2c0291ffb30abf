"""Fault injection for the scheduler recovery tests (proto.faults), read from
CONVEYOR_SCHEDULER_FAULT: `step=N,action=kill|exit|stall[,once=PATH]`. The scheduler fires before
it sends the first plan whose step id is >= N; stall stops its loop for good (no step, no
heartbeat) until it is killed."""

from __future__ import annotations

import os

from proto.faults import Fault, parse_faults

VARIABLE = "CONVEYOR_SCHEDULER_FAULT"


def scheduler_fault(environ: dict[str, str] | None = None) -> Fault | None:
    """The fault CONVEYOR_SCHEDULER_FAULT names, or None; ValueError names a malformed one."""
    text = (os.environ if environ is None else environ).get(VARIABLE, "")
    faults = parse_faults(VARIABLE, text, with_rank=False)
    if len(faults) > 1:
        raise ValueError(f"{VARIABLE}: one fault at a time, got {len(faults)} in {text!r}")
    return faults[0] if faults else None
