"""The test-only fault grammar both the worker and the scheduler read (proto.faults)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proto.faults import Fault, InjectedFault, parse_faults
from scheduler_proc.faults import scheduler_fault
from worker_proc.faults import FaultInjector


def test_several_worker_faults_parse_and_each_rank_keeps_its_own() -> None:
    text = "rank=0,step=3,action=kill; rank=1,step=5,action=stall,once=/tmp/x"
    assert parse_faults("V", text, with_rank=True) == [Fault(3, "kill", "", 0), Fault(5, "stall", "/tmp/x", 1)]
    injector = FaultInjector(1, {"CONVEYOR_FAULT_INJECTION": text})
    assert injector.faults == [Fault(5, "stall", "/tmp/x", 1)]
    assert FaultInjector(2, {"CONVEYOR_FAULT_INJECTION": text}).faults == []


@pytest.mark.parametrize("text, with_rank, message", [
    ("step=3,action=kill", True, "cannot read 'step=3,action=kill'"),  # no rank
    ("rank=0,step=3,action=kill", False, "unknown keys ['rank']"),  # a scheduler has no ranks
    ("rank=0,step=three,action=kill", True, "cannot read"),
    ("rank=0,step=3,action=explode", True, "an action not in ('kill', 'exit', 'stall', 'segv', 'raise')"),
    ("rank=0,step=3,action=kill,when=now", True, "unknown keys ['when']"),
    ("rank=0,step=3,action", True, "cannot read"),
])
def test_a_malformed_fault_names_the_variable_and_what_is_wrong(text: str, with_rank: bool, message: str) -> None:
    with pytest.raises(ValueError, match="^V: ") as caught:
        parse_faults("V", text, with_rank)
    assert message in str(caught.value)


def test_the_scheduler_takes_one_fault_or_none() -> None:
    assert scheduler_fault({}) is None
    assert scheduler_fault({"CONVEYOR_SCHEDULER_FAULT": " step=7,action=exit "}) == Fault(7, "exit")
    with pytest.raises(ValueError, match="one fault at a time, got 2"):
        scheduler_fault({"CONVEYOR_SCHEDULER_FAULT": "step=1,action=kill;step=2,action=kill"})


def test_a_fault_waits_for_its_step_and_once_claims_its_file(tmp_path: Path) -> None:
    once = tmp_path / "fired"
    fault = Fault(5, "exit", str(once))
    fault.fire(4)  # before its step: nothing happens, nothing is claimed
    assert not once.exists()
    once.touch()  # an earlier process fired it: this one runs on
    fault.fire(5)
    fault.fire(6)


def test_a_raise_fault_raises_in_the_caller_at_its_step_and_only_once_with_once(tmp_path: Path) -> None:
    fault = Fault(3, "raise", str(tmp_path / "fired"))
    fault.fire(2)
    with pytest.raises(InjectedFault, match="injected fault at step 3"):
        fault.fire(3)
    fault.fire(4)  # claimed: the replacement runs on


def test_a_segv_fault_ends_its_process_with_a_segmentation_fault() -> None:
    code = "from proto.faults import Fault; Fault(1, 'segv').fire(1); print('survived')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGSEGV and "survived" not in done.stdout
