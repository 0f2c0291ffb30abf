"""deploy: `conveyor bench` and `bench sweep` refuse impossible arguments, name what failed, and
measure a real server (the tiny model) into JSON and PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import tiny_config

from deploy.bench_sweep import find_knee
from deploy.cli import main
from deploy.launcher import Stack
from deploy.replay import ReplayOptions
from deploy.trace import TraceSpec, make_trace
from proto.trace import load_trace, save_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL_TRACE = ["--num-prompts", "6", "--request-rate", "20", "--prompt-len-min", "4", "--prompt-len-max", "8",
               "--output-median", "4", "--output-max", "8", "--disable-tqdm"]


@pytest.mark.parametrize("args, message", [
    (["--max-concurrency", "-1"], "--max-concurrency must be >= 0"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--endpoint", "v1/completions"], "--endpoint must be a path"),
    (["--num-prompts", "-5"], "--num-prompts must be >= 1, got -5"),
    (["--request-rate", "nan"], "--request-rate must be > 0"),
    (["--constrained-fraction", "1.5"], "--constrained-fraction must be in [0, 1], got 1.5"),
    (["--json-schema", "/nonexistent/schema.json"], "/nonexistent/schema.json"),
])
def test_bench_refuses_impossible_arguments_with_exit_2(args: list[str], message: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--base-url", "http://127.0.0.1:9", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_an_empty_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["bench", "--trace", str(tmp_path / "empty.jsonl")]) == 2
    assert "holds no trace entries" in capsys.readouterr().err


def test_bench_with_a_named_model_and_no_server_says_every_request_to_which_url_failed(
        capsys: pytest.CaptureFixture) -> None:
    args = ["bench", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2", "--disable-tqdm"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "every request to http://127.0.0.1:9/v1/completions failed" in err and "ConnectError" in err


def test_the_knee_is_the_largest_error_free_batch_within_the_itl_target() -> None:
    runs = [{"max_num_seqs": 1, "itl_p99_ms": 10.0, "errors": 0},
            {"max_num_seqs": 4, "itl_p99_ms": 40.0, "errors": 0},
            {"max_num_seqs": 8, "itl_p99_ms": 45.0, "errors": 2},
            {"max_num_seqs": 16, "itl_p99_ms": 90.0, "errors": 0}]
    assert find_knee(runs, 50.0) == 4
    assert find_knee(runs, 5.0) is None


def test_a_noisy_pass_beyond_the_first_breach_of_the_target_is_not_the_knee() -> None:
    runs = [{"max_num_seqs": 1, "itl_p99_ms": 20.0, "errors": 0},
            {"max_num_seqs": 2, "itl_p99_ms": 60.0, "errors": 0},
            {"max_num_seqs": 4, "itl_p99_ms": 40.0, "errors": 0}]
    assert find_knee(runs, 50.0) == 1


@pytest.mark.parametrize("args, message", [
    (["--max-num-seqs", "0,4"], "batch sizes must be integers >= 1"),
    (["--max-num-seqs", "a,b"], "not a comma-separated list"),
])
def test_bench_sweep_refuses_bad_batch_sizes_at_parse_time(args: list[str], message: str,
                                                           capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "sweep", *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--itl-target-ms", "-1"], "--itl-target-ms must be > 0"),
    (["--request-rate", "-2"], "--request-rate must be > 0"),
    (["--prompt-len-max", "500", "--output-max", "100"], "the model's context is 512"),
])
def test_bench_sweep_refuses_impossible_arguments_before_launching_a_server(
        tiny_model_dir: Path, tmp_path: Path, args: list[str], message: str,
        capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "sweep", "--model-dir", str(tiny_model_dir), "--result-dir", str(tmp_path),
                 *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_against_the_real_stack_completes_every_request_and_writes_json_and_plots(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    trace = make_trace(TraceSpec(num_prompts=5, prompt_len_min=3, prompt_len_max=6, output_median=5,
                                 output_max=9, request_rate=25.0, vocab_high=500))
    save_trace(trace, tmp_path / "trace.jsonl")
    with Stack(tiny_config(tiny_model_dir), log_dir=tmp_path / "logs") as stack:
        code = main(["bench", "--base-url", stack.url, "--trace", str(tmp_path / "trace.jsonl"),
                     "--result-dir", str(tmp_path / "out"), "--label", "tiny", "--disable-tqdm"])
    assert code == 0
    result = json.loads((tmp_path / "out" / "tiny.json").read_text())
    assert (result["completed"], result["errors"]) == (5, 0)
    assert result["output_tokens"] == sum(e.output_len for e in trace)
    assert all(result[key]["p99"] is not None for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"))
    for name in ("tiny-latency-cdf.png", "tiny-tokens-over-time.png"):
        assert (tmp_path / "out" / name).read_bytes()[:8] == PNG_MAGIC


def test_the_constrained_share_of_a_trace_is_spread_evenly_and_needs_a_schema() -> None:
    assert [ReplayOptions(json_schema={}, constrained_fraction=0.5).is_constrained(i) for i in range(6)] == \
        [False, True] * 3
    assert all(ReplayOptions(json_schema={}, constrained_fraction=1.0).is_constrained(i) for i in range(5))
    assert not any(ReplayOptions(constrained_fraction=1.0).is_constrained(i) for i in range(5))


def test_bench_with_a_json_schema_constrains_that_share_of_the_requests_on_the_real_stack(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    trace = make_trace(TraceSpec(num_prompts=4, prompt_len_min=3, prompt_len_max=6, output_median=24,
                                 output_sigma=0.0, output_max=24, request_rate=25.0, vocab_high=500))
    save_trace(trace, tmp_path / "trace.jsonl")
    with Stack(tiny_config(tiny_model_dir), log_dir=tmp_path / "logs") as stack:
        code = main(["bench", "--base-url", stack.url, "--trace", str(tmp_path / "trace.jsonl"),
                     "--json-schema", str(tmp_path / "schema.json"), "--constrained-fraction", "0.5",
                     "--result-dir", str(tmp_path / "out"), "--label", "half", "--disable-tqdm"])
    assert code == 0
    result = json.loads((tmp_path / "out" / "half.json").read_text())
    assert (result["completed"], result["errors"], result["num_constrained"]) == (4, 0, 2)
    tokens = [r["output_tokens"] for r in result["requests"]]
    # The unconstrained ones generate exactly what they asked (ignore_eos); the constrained ones stop
    # when their document {"a": true|false} is complete, well before 24 tokens.
    assert tokens[0] == tokens[2] == 24 and all(n < 24 for n in tokens[1::2]), tokens


def test_bench_sweep_launches_conveyor_per_batch_size_and_names_the_knee(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["bench", "sweep", "--model-dir", str(tiny_model_dir), "--max-num-seqs", "1,4", *SMALL_TRACE,
            "--dtype", "float32", "--num-kv-blocks", "256", "--num-threads", "1", "--itl-target-ms", "1000",
            "--result-dir", str(tmp_path)]
    assert main(args) == 0
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert [run["max_num_seqs"] for run in summary["runs"]] == [1, 4]
    assert all(run["errors"] == 0 and run["output_tok_per_s"] > 0 for run in summary["runs"])
    assert summary["knee_max_num_seqs"] == 4
    assert "knee: max_num_seqs 4" in capsys.readouterr().out
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    assert len(load_trace(tmp_path / "trace.jsonl")) == 6
