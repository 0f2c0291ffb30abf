"""deploy: `conveyor simulate` runs the scheduler's slot simulator as its own process."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cli import main


def test_simulate_draws_both_timelines_into_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--num-requests", "10", "--num-slots", "3"]) == 0
    printed = capfd.readouterr().out
    assert "static" in printed and "continuous" in printed and "padding waste" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["simulate-continuous.png", "simulate-static.png"]


@pytest.mark.parametrize("args, message", [
    (["--num-slots", "0"], "--num-slots must be >= 1, got 0"),
    (["--num-requests", "-1"], "--num-requests must be >= 1, got -1"),
    (["--num-slots", "two"], "invalid int value"),
])
def test_simulate_refuses_impossible_arguments_with_exit_2(args: list[str], message: str,
                                                           capfd: pytest.CaptureFixture) -> None:
    assert main(["simulate", *args, "--no-plot"]) == 2
    assert message in capfd.readouterr().err
