"""Property tests: random interleavings of add (shared prefixes, n > 1, logprobs), abort (of a
request or of one choice), step and finish on tiny KV caches (so preemption happens), with prefix
caching on, checked against the same run with caching off. The harness checks every invariant
after every operation."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_fakes import Harness, choice_key, default_token

PREFIXES = (list(range(100, 112)), list(range(100, 112)), list(range(500, 506)), [])  # 0 and 1 share

add_op = st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 16), st.integers(1, 3),
                   st.integers(1, 8), st.booleans(), st.booleans(), st.booleans())
abort_op = st.tuples(st.just("abort"), st.integers(0, 11), st.integers(-1, 2))  # choice -1: all
step_op = st.tuples(st.just("step"), st.integers(1, 4))
ops_strategy = st.lists(st.one_of(add_op, add_op, abort_op, step_op, step_op), min_size=1, max_size=24)
config_strategy = st.fixed_dictionaries({
    "num_blocks": st.integers(8, 30),
    "block_size": st.sampled_from([1, 2, 4]),
    "max_num_seqs": st.integers(1, 5),
    "max_num_batched_tokens": st.integers(2, 24),
    "long_prefill_token_threshold": st.sampled_from([0, 2, 5]),
    "max_num_partial_prefills": st.integers(1, 2),
    "scheduling": st.sampled_from(["continuous", "continuous", "static"]),
})


@dataclass
class Workload:
    prompts: dict[str, list[int]] = field(default_factory=dict)
    params: dict[str, dict] = field(default_factory=dict)

    def keys(self) -> set[str]:
        return {choice_key(r, i) for r, p in self.params.items() for i in range(p.get("n", 1))}


def run_ops(config: dict, ops: list[tuple], enable_prefix_caching: bool) -> tuple[Harness, Workload]:
    config = dict(config)
    harness = Harness(num_blocks=config.pop("num_blocks"), max_model_len=60,
                      enable_prefix_caching=enable_prefix_caching, **config)
    workload = Workload()
    for op in ops:
        if op[0] == "add":
            _, variant, suffix_len, n, max_tokens, prompt_logprobs, logprobs, stops = op
            request_id = f"r{len(workload.prompts)}"
            prompt = PREFIXES[variant] + [600 + len(workload.prompts)] * suffix_len
            params = {"n": n, "max_tokens": max_tokens, "prompt_logprobs": 1 if prompt_logprobs else -1,
                      "logprobs": 0 if logprobs else -1}
            if stops:  # stop where that request's choice 0 would emit its third token
                params["stop_token_ids"] = (default_token(request_id, len(prompt) + 2),)
            workload.prompts[request_id], workload.params[request_id] = prompt, params
            harness.add(request_id, prompt, **params)
        elif op[0] == "abort":
            harness.abort(f"r{op[1]}", choice_index=op[2])
        else:
            for _ in range(op[1]):
                harness.step()
    harness.run()
    return harness, workload


def check_logprobs(harness: Harness, workload: Workload) -> None:
    """Each prompt position once, in order (a prefix of them if cut short); one entry per token."""
    log = harness.log
    for key in workload.keys():
        request_id, _, choice = key.partition("#")
        prompt, params = workload.prompts[request_id], workload.params[request_id]
        entries = log.logprobs.get(key, [])
        prompt_positions = [p for p, _, _, _ in entries if p < len(prompt)]
        sampled_positions = [p for p, _, _, _ in entries if p >= len(prompt)]
        expected_prompt = list(range(1, len(prompt))) if params["prompt_logprobs"] >= 0 and not choice else []
        if log.finish_reasons[key] in ("stop", "length"):
            assert prompt_positions == expected_prompt, key
        else:
            assert prompt_positions == expected_prompt[:len(prompt_positions)], key
        num_tokens = len(log.tokens.get(key, []))
        expected_sampled = list(range(len(prompt), len(prompt) + num_tokens)) if params["logprobs"] >= 0 else []
        assert sampled_positions == expected_sampled, key


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config_strategy, ops_strategy)
def test_random_interleavings_end_every_choice_once_and_match_a_run_without_caching(
        config: dict, ops: list[tuple]) -> None:
    cached, workload = run_ops(config, ops, enable_prefix_caching=True)
    log = cached.log
    assert set(log.finish_reasons) == workload.keys()
    manager = cached.engine.block_manager
    assert manager.usage == 0.0 and all(manager.pool.ref_count(b) == 0 for b in range(manager.num_blocks))
    check_logprobs(cached, workload)
    plain, _ = run_ops(config, ops, enable_prefix_caching=False)
    for key, reason in log.finish_reasons.items():
        other_reason, tokens, other = plain.log.finish_reasons[key], log.tokens.get(key, []), plain.log.tokens.get(key, [])
        if "abort" in (reason, other_reason):  # cut at a step that depends on timing
            shorter, longer = sorted((tokens, other), key=len)
            assert longer[:len(shorter)] == shorter, key
        else:
            assert (reason, tokens) == (other_reason, other), key
        if reason == "error":  # only a request larger than the whole (tiny) KV cache
            assert tokens == [] and "whole KV cache" in log.error_messages[key]
