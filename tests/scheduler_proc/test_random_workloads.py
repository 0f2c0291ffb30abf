"""Random workloads: invariants after every operation, one terminal output each, stable tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_fakes import Harness

requests_strategy = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6)),  # prompt, max_tokens, arrival step
    min_size=1, max_size=10)
config_strategy = st.fixed_dictionaries({
    "num_blocks": st.integers(13, 40),
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.integers(1, 48),
    "scheduling": st.sampled_from(["continuous", "static"]),
})


def run_workload(config: dict, workload: list[tuple[int, int, int]], aborts: dict[int, int]) -> Harness:
    config = dict(config)
    num_blocks = config.pop("num_blocks")
    harness = Harness(num_blocks=num_blocks, max_model_len=60, **config)
    for step in range(2000):
        for index, (prompt, max_tokens, arrival) in enumerate(workload):
            if arrival == step:
                harness.add(f"r{index}", prompt, max_tokens=max_tokens)
        for index, abort_step in aborts.items():
            if abort_step == step and index < len(workload):
                harness.abort(f"r{index}")
        if harness.step() is None and step > 6:
            return harness
    raise AssertionError("workload did not finish")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config_strategy, requests_strategy, st.dictionaries(st.integers(0, 9), st.integers(0, 12), max_size=3))
def test_every_request_ends_once_and_tokens_do_not_depend_on_pressure_or_policy(
        config: dict, workload: list[tuple[int, int, int]], aborts: dict[int, int]) -> None:
    pressured = run_workload(config, workload, aborts)
    log = pressured.log
    assert set(log.finish_reasons) == {f"r{i}" for i in range(len(workload))}
    relaxed = run_workload({**config, "num_blocks": 400, "scheduling": "continuous"}, workload, {})
    for request_id, reason in log.finish_reasons.items():
        expected = relaxed.log.tokens.get(request_id, [])
        tokens = log.tokens.get(request_id, [])
        if reason == "abort":
            assert tokens == expected[:len(tokens)]
        elif reason == "error":  # only a request larger than the whole (small) KV cache
            assert tokens == [] and "whole KV cache" in log.error_messages[request_id]
        else:
            assert (reason, tokens) == (relaxed.log.finish_reasons[request_id], expected)
