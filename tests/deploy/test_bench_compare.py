"""deploy: `conveyor bench compare` runs each server alone in ABBA order, measures each run (and the
memory of the server's whole process tree), tables them, and leaves no server process behind."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from deploy.bench_compare import format_markdown, ratios, run_order
from deploy.cli import main
from deploy.model_info import read_model_info
from deploy.server_process import process_tree
from deploy.trace import TraceSpec, make_trace
from proto.trace import save_trace


def test_rounds_run_every_server_in_abba_order() -> None:
    assert run_order(["a", "b"], 3) == [(1, "a"), (1, "b"), (2, "b"), (2, "a"), (3, "a"), (3, "b")]


def _run(trace: str, server: str, round_index: int, tok_per_s: float) -> dict:
    pair = {"p50": 0.5, "p99": 1.0}
    return {"trace": trace, "server": server, "round": round_index, "output_tok_per_s": tok_per_s,
            "duration_s": 100.0, "errors": 0, "ttft_s": pair, "tpot_s": pair, "itl_s": pair, "e2e_s": pair,
            "peak_rss_bytes": 2 * 2**30, "startup_s": 4.0}


def test_the_first_server_is_compared_with_each_other_on_the_means_of_their_rounds() -> None:
    runs = [_run("heavy", "conveyor", 1, 120.0), _run("heavy", "vllm", 1, 100.0),
            _run("heavy", "vllm", 2, 80.0), _run("heavy", "conveyor", 2, 100.0)]
    assert ratios(runs, ["conveyor", "vllm"]) == {"heavy": {"vllm": round(110 / 90, 3)}}
    table = format_markdown({"cpu": {"model": "X", "cores": 2, "isa_flags": ["avx2"]},
                             "servers": {"conveyor": "c {port}", "vllm": "v {port}"},
                             "runs": runs, "ratios": ratios(runs, ["conveyor", "vllm"])})
    assert "| heavy | vllm, 2 | 100.0 s | **80.0** | 0.50 / 1.00 s |" in table
    runs[0]["tpot_s"] = {"p50": 0.0226, "p99": 0.0235}  # a single stream's: in ms
    assert "| heavy | conveyor, 1 | 100.0 s | **120.0** | 0.50 / 1.00 s | 22.6 / 23.5 ms |" in format_markdown(
        {"cpu": {"model": "X", "cores": 2, "isa_flags": []}, "servers": {"conveyor": "c", "vllm": "v"},
         "runs": runs, "ratios": {}})
    assert "heavy: conveyor's output tok/s (mean of its rounds) is 1.22x vllm's" in table


@pytest.mark.parametrize("server, message", [
    ("noequals", "--server takes NAME=COMMAND"), ("bad name=x {port}", "--server takes NAME=COMMAND"),
    ("a=serve --port 8000", "must contain {port}")])
def test_a_server_spec_without_a_name_or_a_port_is_refused(server: str, message: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "compare", "--trace", str(tmp_path / "t.jsonl"), "--server", server])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_two_servers_of_one_name_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "compare", "--trace", str(tmp_path / "t.jsonl"), "--server", "a=x {port}",
                 "--server", "a=y {port}"]) == 2
    assert "each --server needs a name of its own" in capsys.readouterr().err


def test_a_server_that_exits_before_answering_is_named_with_its_log(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "t.jsonl"
    save_trace(make_trace(TraceSpec(num_prompts=2)), trace)
    assert main(["bench", "compare", "--trace", str(trace), "--server", "broken=echo no server on {port}; exit 3",
                 "--rounds", "1", "--result-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "broken: `echo no server on" in err and "exited with status 3" in err and "broken-round1.log" in err


LAUNCHER = """
import subprocess, sys, time, urllib.request
port, command = sys.argv[1], " ".join(sys.argv[2:]).replace("{port}", sys.argv[1])
server = subprocess.Popen(command, shell=True, start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
while True:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        break
    except OSError:
        time.sleep(0.2)
print(f"server pid={server.pid}", flush=True)
"""


def test_compare_serves_a_foreground_and_a_background_server_and_stops_both(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "small.jsonl"
    save_trace(make_trace(TraceSpec(num_prompts=4, prompt_len_min=4, prompt_len_max=8, output_median=4, output_max=6,
                                    vocab_high=read_model_info(tiny_model_dir).vocab_size)), trace)
    serve = (f"{shlex.quote(sys.executable)} -m deploy.cli serve {shlex.quote(str(tiny_model_dir))} --port {{port}} "
             "--dtype float32 --num-kv-blocks 128 --num-threads 1 --log-level warning")
    # like ../shared/peers/vllm-cpu.sh: starts the server, waits until it answers, prints pid=N and exits
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    background = f"{shlex.quote(sys.executable)} {shlex.quote(str(launcher))} {{port}} {serve}"
    out = tmp_path / "out"
    assert main(["bench", "compare", "--trace", str(trace), "--server", f"fg={serve}", "--server",
                 f"bg={background}", "--rounds", "1", "--disable-tqdm", "--result-dir", str(out)]) == 0
    summary = json.loads((out / "compare.json").read_text())
    assert [(r["server"], r["round"], r["trace"]) for r in summary["runs"]] == [("fg", 1, "small"), ("bg", 1, "small")]
    for run in summary["runs"]:
        assert run["errors"] == 0 and run["completed"] == 4 and run["output_tok_per_s"] > 0
        assert run["peak_rss_bytes"] > 100 * 2**20  # the supervisor, scheduler, worker and frontend together
        assert run["startup_s"] > 0 and "{port}" not in run["server_command"]
    assert set(summary["ratios"]["small"]) == {"bg"}
    assert "| small | bg, 1 |" in capsys.readouterr().out
    assert (out / "compare.md").read_text().startswith("CPU: ")
    for log in ("fg-round1.log", "bg-round1.log"):
        assert (out / log).exists()
    bg_pid = int((out / "bg-round1.log").read_text().split("pid=")[-1].split()[0])
    assert process_tree([bg_pid]) == []  # the background server's tree is gone too
