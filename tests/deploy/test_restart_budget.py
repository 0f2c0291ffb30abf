"""deploy.restarts: the sliding-window restart budget and the error that stops the stack."""

from __future__ import annotations

from deploy.restarts import RestartBudget


def test_restarts_up_to_max_within_the_window_are_allowed_and_the_next_is_refused() -> None:
    budget = RestartBudget(max_restarts=3, window_s=60.0)
    allowed = [budget.allow(f"fault {i}", now_s=100.0 + i) for i in range(3)]
    assert allowed == [True, True, True]
    assert budget.allow("fault 3", now_s=103.0) is False
    assert budget.num_restarts_total == 3


def test_a_refused_restart_is_not_counted_and_stays_refused() -> None:
    budget = RestartBudget(max_restarts=1, window_s=60.0)
    assert budget.allow("first", now_s=0.0)
    assert not budget.allow("second", now_s=1.0)
    assert not budget.allow("third", now_s=2.0)
    assert budget.num_restarts_total == 1


def test_a_restart_is_allowed_again_once_old_ones_leave_the_window() -> None:
    budget = RestartBudget(max_restarts=2, window_s=10.0)
    assert budget.allow("a", now_s=0.0)
    assert budget.allow("b", now_s=5.0)
    assert not budget.allow("c", now_s=10.0)  # "a" is exactly window_s old: still inside
    assert budget.allow("d", now_s=10.5)  # "a" has left the window, "b" has not
    assert not budget.allow("e", now_s=12.0)
    assert budget.allow("f", now_s=15.5)  # "b" has left too
    assert budget.num_restarts_total == 4


def test_exhausted_names_the_cause_the_limit_and_the_earlier_causes_in_the_window() -> None:
    budget = RestartBudget(max_restarts=2, window_s=30.0)
    budget.allow("worker rank 0 was killed by SIGKILL", now_s=0.0)
    budget.allow("scheduler exited with code 1", now_s=40.0)
    budget.allow("frontend exited with code 2", now_s=45.0)
    assert not budget.allow("worker rank 1 hung", now_s=50.0)
    message = budget.exhausted("worker rank 1 hung")
    assert message.startswith("worker rank 1 hung;")
    assert "--max-restarts 2" in message
    assert "30 s" in message
    assert "scheduler exited with code 1; frontend exited with code 2" in message
    assert "SIGKILL" not in message  # left the window before the fault that stops the stack


def test_zero_max_restarts_refuses_the_first_restart() -> None:
    budget = RestartBudget(max_restarts=0, window_s=600.0)
    assert not budget.allow("worker rank 0 was killed by SIGKILL", now_s=1.0)
    assert budget.num_restarts_total == 0
    message = budget.exhausted("worker rank 0 was killed by SIGKILL")
    assert "--max-restarts 0" in message
    assert "earlier causes: none" in message


def test_describe_counts_restarts_in_the_window_and_in_all() -> None:
    budget = RestartBudget(max_restarts=2, window_s=10.0)
    budget.allow("a", now_s=0.0)
    budget.allow("b", now_s=20.0)
    assert budget.describe() == "restart 1 of at most 2 within 10 s, 2 in all"
