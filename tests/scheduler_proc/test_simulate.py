"""scheduler_proc.tools.simulate: the real engine's policies, static vs continuous, seat by seat."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scheduler_proc.tools.simulate import (GENERATING, HELD, IDLE, POLICIES, WorkloadSpec, main, make_workload,
                                     simulate)

ROOT = Path(__file__).resolve().parents[2]


def _both(spec: WorkloadSpec, num_slots: int) -> tuple:
    workload = make_workload(spec)
    return tuple(simulate(workload, num_slots, policy) for policy in POLICIES)


def test_with_one_slot_static_and_continuous_come_out_identical() -> None:
    static, continuous = _both(WorkloadSpec(num_requests=20, seed=3), num_slots=1)
    assert np.array_equal(static.timeline, continuous.timeline)
    assert static.finish_steps == continuous.finish_steps
    assert static.padding_waste == continuous.padding_waste == 0.0


def test_with_uniform_lengths_the_continuous_advantage_nearly_vanishes() -> None:
    uniform = WorkloadSpec(lengths="uniform", length_median=16)
    static, continuous = _both(uniform, num_slots=8)
    assert static.mean_latency_steps / continuous.mean_latency_steps < 1.2
    assert static.num_steps / continuous.num_steps < 1.2
    assert static.padding_waste == 0.0
    heavy_static, heavy_continuous = _both(WorkloadSpec(lengths="heavy", length_median=16), num_slots=8)
    assert heavy_static.mean_latency_steps / heavy_continuous.mean_latency_steps > 2.0


def test_uniform_lengths_arriving_at_once_give_identical_timelines() -> None:
    static, continuous = _both(WorkloadSpec(lengths="uniform", arrival_steps=1), num_slots=8)
    assert np.array_equal(static.timeline, continuous.timeline)
    assert static.finish_steps == continuous.finish_steps


def test_heavy_tailed_lengths_leave_static_seats_held_and_continuous_seats_busy() -> None:
    static, continuous = _both(WorkloadSpec(num_requests=64, seed=0), num_slots=8)
    assert static.padding_waste > 0.3 and continuous.padding_waste == 0.0
    assert continuous.slot_utilisation > static.slot_utilisation
    within = continuous.num_steps
    assert continuous.completed_within(within) == 64 > static.completed_within(within)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_generates_exactly_its_drawn_length_in_one_seat(policy: str) -> None:
    workload = make_workload(WorkloadSpec(num_requests=30, seed=5))
    result = simulate(workload, 4, policy)
    for index, length in enumerate(workload.lengths):
        cells = (result.occupants == index) & (result.timeline == GENERATING)  # bool [slots, steps]
        assert cells.sum() == length
        assert len(set(np.nonzero(cells)[0])) == 1, "a request changed seats"
        assert result.finish_steps[index] == np.nonzero(cells)[1].max()
    assert ((result.occupants == -1) == (result.timeline == IDLE)).all()


def test_a_static_seat_is_held_only_while_its_batch_still_generates() -> None:
    static, _ = _both(WorkloadSpec(num_requests=40, seed=2), num_slots=6)
    steps_with_padding = (static.timeline == HELD).any(axis=0)  # bool [num_steps]
    steps_generating = (static.timeline == GENERATING).any(axis=0)  # bool [num_steps]
    assert steps_with_padding.any()
    assert not (steps_with_padding & ~steps_generating).any()


@pytest.mark.parametrize("args, message", [
    (["--num-slots", "0"], "--num-slots must be >= 1, got 0"),
    (["--num-requests", "-3"], "--num-requests must be >= 1, got -3"),
    (["--length-median", "0"], "--length-median"),
    (["--length-median", "40", "--length-max", "20"], "--length-max"),
    (["--length-sigma", "-1"], "--length-sigma must be >= 0"),
    (["--arrival-steps", "0"], "--arrival-steps must be in [1, 100000], got 0"),
    (["--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["--within-steps", "-1"], "--within-steps must be >= 0"),
    (["--num-requests", "10000", "--lengths", "uniform", "--length-median", "100"], "at most 200000"),
    (["--num-slots", "4096", "--num-requests", "1000", "--lengths", "uniform", "--length-median", "100"],
     "timeline cells"),
])
def test_impossible_arguments_are_refused_with_exit_2_and_the_value(
        args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main([*args, "--no-plot"]) == 2
    assert message in capsys.readouterr().err


def test_a_malformed_number_is_refused_by_the_parser_with_exit_2() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--num-slots", "many"])
    assert exited.value.code == 2


def test_the_simulator_prints_both_policies_and_draws_one_png_per_policy(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--num-requests", "12", "--num-slots", "3", "--out-dir", str(tmp_path / "img")]) == 0
    printed = capsys.readouterr().out
    for row in ("completed within", "slot utilisation", "padding waste", "mean latency"):
        assert row in printed
    for policy in POLICIES:
        png = tmp_path / "img" / f"simulate-{policy}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_importing_the_simulator_loads_neither_matplotlib_nor_torch() -> None:
    code = ("import sys, scheduler_proc.tools.simulate, scheduler_proc.tools.simulate_report; "
            "assert 'matplotlib' not in sys.modules and 'torch' not in sys.modules, 'heavy import'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_timeline_changes_shade_whenever_a_new_request_boards_a_seat() -> None:
    from scheduler_proc.tools.simulate_report import display_codes

    _, continuous = _both(WorkloadSpec(num_requests=30, seed=1), num_slots=3)
    codes = display_codes(continuous)  # int8 [num_slots, num_steps]
    occupants = continuous.occupants
    boards = (occupants[:, 1:] != occupants[:, :-1]) & (occupants[:, 1:] >= 0) & (occupants[:, :-1] >= 0)
    assert boards.any()
    assert (codes[:, 1:][boards] != codes[:, :-1][boards]).all()
