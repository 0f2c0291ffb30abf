"""`conveyor bench recovery` times real faults: a stopped (SIGSTOP) worker is found at the step
timeout and a stopped scheduler at the frontend's silence bound, and the stream still finishes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from support import metric_value, supervised, tiny_config

from deploy import bench_recovery
from deploy.launcher import Stack
from frontend.engine_client import HANG_AFTER_S


def bench(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict | str]:
    parser = argparse.ArgumentParser()
    bench_recovery.add_arguments(parser)
    code = bench_recovery.run(parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else err


def test_a_stopped_worker_of_a_running_server_is_reported_stalled_then_replaced(
        tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """--url: the benchmark launches nothing and stops the process it is given. /health says
    'stalled' past --stall-timeout; the group is replaced at --step-timeout."""
    config = tiny_config(tiny_model_dir, stall_timeout_s=1.0, step_timeout_s=3.0)
    with Stack(config) as stack, supervised(stack):
        worker = next(child.process.pid for child in stack.children if child.module == "worker_proc")
        code, summary = bench(capsys, "--url", stack.url, "--pid", str(worker), "--fault", "hang",
                              "--kill-after-tokens", "3", "--max-tokens", "200")  # one trial with --url
        assert code == 0, summary
        assert metric_value(stack.url, "conveyor:process_restarts_total", process="worker") == 1
    trial, = summary["trials"]
    assert (summary["process"], summary["fault"], summary["dtype"]) == ("worker", "hang", "float32")
    assert trial["unhealthy_status"] == "stalled"
    assert trial["hang_to_unhealthy_s"] < 3.0 <= trial["hang_to_serving_s"] + 0.5
    # /health is polled every 50 ms, and a request may wait on a busy machine.
    assert trial["hang_to_serving_s"] <= trial["hang_to_next_token_s"] + 1.0
    assert summary["hang_to_next_token_s_median"] == trial["hang_to_next_token_s"]


def test_a_stopped_scheduler_is_found_by_the_frontend_and_replaced(
        tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code, summary = bench(capsys, "--model-dir", str(tiny_model_dir), "--process", "scheduler", "--fault",
                          "hang", "--trials", "1", "--kill-after-tokens", "3", "--max-tokens", "200")
    assert code == 0, summary
    trial, = summary["trials"]
    # The frontend reports it after HANG_AFTER_S of silence; /health is 503 before that (alive timeout).
    assert trial["unhealthy_status"] == "engine_unavailable"
    assert trial["hang_to_unhealthy_s"] < HANG_AFTER_S <= trial["hang_to_resubmitted_s"]
    assert trial["hang_to_resubmitted_s"] <= trial["hang_to_next_token_s"] + 1.0


def test_a_frontend_hang_is_refused_with_the_reason(tiny_model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = bench(capsys, "--model-dir", str(tiny_model_dir), "--process", "frontend", "--fault", "hang")
    assert code == 2
    assert "--fault hang takes --process worker or scheduler" in err


def test_url_without_a_pid_or_with_several_trials_is_refused(capsys: pytest.CaptureFixture) -> None:
    for argv in (["--url", "http://127.0.0.1:1"], ["--url", "http://127.0.0.1:1", "--pid", "1", "--trials", "2"]):
        code, err = bench(capsys, *argv)
        assert code == 2
        assert "--url takes --pid" in err
