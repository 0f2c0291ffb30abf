"""deploy: benchmark traces are reproducible, shaped as asked, and bad arguments are refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deploy.trace import TraceSpec, make_trace
from proto.trace import load_trace, save_trace


def test_the_same_seed_gives_the_same_trace_and_it_survives_jsonl(tmp_path: Path) -> None:
    spec = TraceSpec(num_prompts=20, prompt_len_min=4, prompt_len_max=9, request_rate=5.0, seed=3)
    trace = make_trace(spec)
    assert trace == make_trace(spec)
    save_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace


def test_heavy_tailed_outputs_have_the_asked_median_and_cap() -> None:
    trace = make_trace(TraceSpec(num_prompts=2000, prompt_len_min=1, prompt_len_max=1, seed=1))
    lengths = sorted(e.output_len for e in trace)
    assert 40 <= lengths[len(lengths) // 2] <= 56
    assert max(lengths) <= 512 and max(lengths) > 200  # heavy tail reaches far past the median


def test_uniform_outputs_are_all_the_same_length_and_burst_arrives_at_once() -> None:
    trace = make_trace(TraceSpec(num_prompts=50, output_dist="uniform", output_median=30))
    assert {e.output_len for e in trace} == {30}
    assert {e.arrival_s for e in trace} == {0.0}


def test_poisson_arrivals_increase_at_roughly_the_asked_rate() -> None:
    trace = make_trace(TraceSpec(num_prompts=500, prompt_len_min=1, prompt_len_max=1, request_rate=10.0))
    arrivals = [e.arrival_s for e in trace]
    assert arrivals == sorted(arrivals)
    assert 40 < arrivals[-1] < 60


@pytest.mark.parametrize("kwargs, message", [
    ({"num_prompts": 0}, "num-prompts"), ({"request_rate": -1.0}, "request-rate"),
    ({"prompt_len_min": 10, "prompt_len_max": 5}, "prompt lengths"),
    ({"output_median": 600}, "output lengths"), ({"request_rate": 0.0}, "request-rate"),
])
def test_impossible_trace_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_trace(TraceSpec(**kwargs))


def test_infinite_rate_means_a_burst() -> None:
    assert TraceSpec().request_rate == math.inf


def test_bench_against_an_unreachable_server_says_which_url_failed(capsys: pytest.CaptureFixture) -> None:
    from deploy.cli import main

    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2"]) == 1
    assert "http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_bench_refuses_a_negative_rate(capsys: pytest.CaptureFixture) -> None:
    from deploy.cli import main

    assert main(["bench", "--request-rate", "-2"]) == 2
    assert "request-rate" in capsys.readouterr().err


def test_a_shared_prefix_starts_every_prompt_and_the_rest_is_unique() -> None:
    trace = make_trace(TraceSpec(num_prompts=10, shared_prefix_len=1024, prompt_len_min=32,
                                 prompt_len_max=128, seed=2))
    prefix = trace[0].prompt_token_ids[:1024]
    assert all(e.prompt_token_ids[:1024] == prefix for e in trace)
    assert all(32 <= len(e.prompt_token_ids) - 1024 <= 128 for e in trace)
    assert len({tuple(e.prompt_token_ids[1024:]) for e in trace}) == 10
