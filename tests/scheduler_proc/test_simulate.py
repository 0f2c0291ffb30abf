"""scheduler_proc.tools.simulate: the real engine's policies, static vs continuous, seat by seat,
on the workloads `conveyor simulate` draws with deploy's trace generator."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deploy.simulate import DEFAULTS
from deploy.trace import make_trace
from proto.trace import TraceEntry, save_trace
from scheduler_proc.tools.simulate import (GENERATING, HELD, IDLE, POLICIES, Workload, main, simulate,
                                           workload_from_trace)

ROOT = Path(__file__).resolve().parents[2]


def _workload(**changes: object) -> Workload:
    """The trace `conveyor simulate` draws with these flags changed, counted in default steps."""
    return workload_from_trace(make_trace(dataclasses.replace(DEFAULTS, **changes)))


def _both(workload: Workload, num_slots: int) -> tuple:
    return tuple(simulate(workload, num_slots, policy) for policy in POLICIES)


def _trace_file(tmp_path: Path, entries: list[TraceEntry]) -> str:
    save_trace(entries, tmp_path / "trace.jsonl")
    return str(tmp_path / "trace.jsonl")


def test_arrivals_are_counted_in_steps_of_the_step_duration_in_arrival_order() -> None:
    entries = [TraceEntry(arrival_s, [1], 1) for arrival_s in (0.15, 0.0, 0.049, 0.05)]
    workload = workload_from_trace(entries, step_ms=50.0)
    assert workload.arrival_steps == [0, 0, 1, 3]
    assert workload_from_trace(entries, step_ms=10.0).arrival_steps == [0, 4, 5, 15]


def test_with_one_slot_static_and_continuous_come_out_identical() -> None:
    static, continuous = _both(_workload(num_prompts=20, seed=3), num_slots=1)
    assert np.array_equal(static.timeline, continuous.timeline)
    assert static.finish_steps == continuous.finish_steps
    assert static.padding_waste == continuous.padding_waste == 0.0


def test_with_uniform_lengths_the_continuous_advantage_nearly_vanishes() -> None:
    static, continuous = _both(_workload(output_dist="uniform"), num_slots=8)
    assert static.mean_latency_steps / continuous.mean_latency_steps < 1.2
    assert static.num_steps / continuous.num_steps < 1.2
    assert static.padding_waste == 0.0
    heavy_static, heavy_continuous = _both(_workload(output_dist="heavy"), num_slots=8)
    assert heavy_static.mean_latency_steps / heavy_continuous.mean_latency_steps > 2.0


def test_uniform_lengths_arriving_at_once_give_identical_timelines() -> None:
    static, continuous = _both(_workload(output_dist="uniform", request_rate=math.inf), num_slots=8)
    assert np.array_equal(static.timeline, continuous.timeline)
    assert static.finish_steps == continuous.finish_steps


def test_heavy_tailed_lengths_leave_static_seats_held_and_continuous_seats_busy() -> None:
    static, continuous = _both(_workload(num_prompts=64, seed=0), num_slots=8)
    assert static.padding_waste > 0.3 and continuous.padding_waste == 0.0
    assert continuous.slot_utilisation > static.slot_utilisation
    within = continuous.num_steps
    assert continuous.completed_within(within) == 64 > static.completed_within(within)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("prompts", [{}, {"prompt_len_min": 5, "prompt_len_max": 40, "shared_prefix_len": 16}])
def test_every_request_generates_exactly_its_drawn_length_in_one_seat(policy: str, prompts: dict) -> None:
    workload = _workload(num_prompts=30, seed=5, **prompts)
    result = simulate(workload, 4, policy)
    for index, length in enumerate(workload.lengths):
        cells = (result.occupants == index) & (result.timeline == GENERATING)  # bool [slots, steps]
        assert cells.sum() == length
        assert len(set(np.nonzero(cells)[0])) == 1, "a request changed seats"
        assert result.finish_steps[index] == np.nonzero(cells)[1].max()
        assert result.arrival_steps[index] <= np.nonzero(cells)[1].min()
    assert ((result.occupants == -1) == (result.timeline == IDLE)).all()


def test_a_static_seat_is_held_only_while_its_batch_still_generates() -> None:
    static, _ = _both(_workload(num_prompts=40, seed=2), num_slots=6)
    steps_with_padding = (static.timeline == HELD).any(axis=0)  # bool [num_steps]
    steps_generating = (static.timeline == GENERATING).any(axis=0)  # bool [num_steps]
    assert steps_with_padding.any()
    assert not (steps_with_padding & ~steps_generating).any()


@pytest.mark.parametrize("args, entries, message", [
    (["--num-slots", "0"], [(0.0, 4)], "--num-slots must be >= 1, got 0"),
    (["--step-ms", "0"], [(0.0, 4)], "--step-ms must be a finite number > 0, got 0.0"),
    (["--within-steps", "-1"], [(0.0, 4)], "--within-steps must be >= 0"),
    ([], [(0.0, 100)] * 2001, "at most 200000"),
    ([], [(0.0, 4), (5000.0, 4)], "arrives at step 100000; the simulator takes at most 100000"),
    (["--num-slots", "4096"], [(0.0, 100)] * 1000, "timeline cells"),
])
def test_impossible_arguments_are_refused_with_exit_2_and_the_value(
        args: list[str], entries: list[tuple[float, int]], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    trace = _trace_file(tmp_path, [TraceEntry(arrival_s, [1], length) for arrival_s, length in entries])
    assert main(["--trace", trace, *args, "--no-plot"]) == 2
    assert message in capsys.readouterr().err


def test_a_trace_that_is_missing_or_malformed_is_refused_with_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--trace", str(tmp_path / "absent.jsonl"), "--no-plot"]) == 2
    assert "absent.jsonl" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "prompt_token_ids": [1], "output_len": 0}\n')
    assert main(["--trace", str(tmp_path / "bad.jsonl"), "--no-plot"]) == 2
    assert "bad.jsonl:1: output_len must be >= 1, got 0" in capsys.readouterr().err


def test_a_malformed_number_is_refused_by_the_parser_with_exit_2(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--trace", _trace_file(tmp_path, [TraceEntry(0.0, [1], 1)]), "--num-slots", "many"])
    assert exited.value.code == 2


def test_the_simulator_prints_both_policies_and_draws_one_png_per_policy(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = _trace_file(tmp_path, make_trace(dataclasses.replace(DEFAULTS, num_prompts=12)))
    assert main(["--trace", trace, "--num-slots", "3", "--out-dir", str(tmp_path / "img")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("12 requests, output lengths ")
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

    _, continuous = _both(_workload(num_prompts=30, seed=1), num_slots=3)
    codes = display_codes(continuous)  # int8 [num_slots, num_steps]
    occupants = continuous.occupants
    boards = (occupants[:, 1:] != occupants[:, :-1]) & (occupants[:, 1:] >= 0) & (occupants[:, :-1] >= 0)
    assert boards.any()
    assert (codes[:, 1:][boards] != codes[:, :-1][boards]).all()
