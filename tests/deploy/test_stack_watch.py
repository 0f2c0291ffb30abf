"""Stack.watch: a stop asked for while it waits wins over replacing a process that exited meanwhile."""

from __future__ import annotations

from deploy.children import Child
from deploy.launcher import Stack
from proto.config import EngineConfig


def test_a_child_that_exits_while_a_stop_is_asked_for_is_not_replaced(monkeypatch) -> None:
    stack = Stack(EngineConfig(model="m"))
    asked = {"stop": False}
    replaced: list[str] = []

    def wait_while_a_second_signal_stops_the_children(wait_s: float) -> str:
        asked["stop"] = True  # the signal handler ran during the wait, and the children exit
        return ""

    monkeypatch.setattr(stack, "_reported_failure", wait_while_a_second_signal_stops_the_children)
    monkeypatch.setattr(stack, "_follow_group", lambda: "")
    monkeypatch.setattr(stack, "dead_child", lambda: Child("worker0", "worker_proc", ["--rank", "0"]))
    monkeypatch.setattr(stack, "_replace_workers", lambda child: replaced.append(child.name) or "")
    assert stack.watch(lambda: asked["stop"], poll_s=0.01) == "shutdown requested"
    assert replaced == [] and not stack.failure
