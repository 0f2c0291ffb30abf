"""deploy: `conveyor simulate` draws the workload with the bench trace generator and runs the
scheduler's slot simulator on it as its own process."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.cli import main
from proto.trace import load_trace


def test_simulate_draws_both_timelines_into_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--num-prompts", "10", "--num-slots", "3"]) == 0
    printed = capfd.readouterr().out
    assert "static" in printed and "continuous" in printed and "padding waste" in printed
    assert printed.startswith("10 requests, ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["simulate-continuous.png", "simulate-static.png"]


def test_the_saved_trace_is_the_one_simulated_and_replaying_it_gives_the_same_figures(
        tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    trace = tmp_path / "trace.jsonl"
    drawn = ["--num-prompts", "12", "--output-median", "6", "--seed", "4", "--num-slots", "3", "--no-plot"]
    assert main(["simulate", *drawn, "--save-trace", str(trace)]) == 0
    first = capfd.readouterr().out
    assert len(load_trace(trace)) == 12
    assert main(["simulate", "--trace", str(trace), "--num-slots", "3", "--no-plot"]) == 0
    assert capfd.readouterr().out == first
    assert main(["simulate", *drawn[:-3], "--seed", "5", "--num-slots", "3", "--no-plot"]) == 0
    assert capfd.readouterr().out != first


def test_simulate_help_shows_the_trace_flags_and_the_simulators_own(capfd: pytest.CaptureFixture) -> None:
    assert main(["simulate", "--help"]) == 0
    printed = capfd.readouterr().out
    for flag in ("--num-prompts", "--output-dist", "--request-rate", "--num-slots", "--step-ms"):
        assert flag in printed


@pytest.mark.parametrize("args, message", [
    (["--num-slots", "0"], "--num-slots must be >= 1, got 0"),
    (["--num-prompts", "-1"], "--num-prompts must be >= 1, got -1"),
    (["--output-median", "40", "--output-max", "20"], "output lengths need 1 <= median <= max, got 40, 20"),
    (["--step-ms", "-5"], "--step-ms must be a finite number > 0, got -5.0"),
    (["--num-slots", "two"], "invalid int value"),
])
def test_simulate_refuses_impossible_arguments_with_exit_2(args: list[str], message: str,
                                                           capfd: pytest.CaptureFixture) -> None:
    assert main(["simulate", *args, "--no-plot"]) == 2
    assert message in capfd.readouterr().err


def test_a_malformed_trace_flag_is_refused_by_the_parser_with_exit_2() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["simulate", "--num-prompts", "many"])
    assert exited.value.code == 2
