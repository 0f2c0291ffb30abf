"""FrontendWatch: which frontend the scheduler serves, and whether its process still lives."""

from __future__ import annotations

from scheduler_proc.frontend_watch import FrontendWatch


def test_a_hello_names_the_predecessor_only_when_its_process_has_exited() -> None:
    alive = {1: True, 2: True}
    watch = FrontendWatch(lambda pid: alive[pid], interval_s=3600.0)  # never looks by itself here
    assert watch.greet(1) is None  # nothing watched before
    assert watch.greet(1) is None  # the same frontend again
    assert watch.greet(2) is None and watch.pid == 2  # frontend 1 still lives
    alive[2] = False
    assert watch.greet(1) == 2 and watch.pid == 1  # 2 exited before the watch looked again
    assert not watch.exited()


def test_an_exit_the_watch_took_is_not_named_again_by_the_next_hello() -> None:
    alive = {1: True, 2: True}
    watch = FrontendWatch(lambda pid: alive[pid], interval_s=0.0)
    watch.greet(1)
    alive[1] = False
    assert watch.take_exited() == 1 and watch.pid is None
    assert watch.greet(2) is None
