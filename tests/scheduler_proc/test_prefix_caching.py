"""Prefix caching through the engine: hits skip computation, survive finishing and preemption, and
never change a token (the fake worker checks every KV slot it reads)."""

from __future__ import annotations

import numpy as np

from scheduler_fakes import Harness

SYSTEM_PROMPT = list(range(200, 216))  # 16 tokens = 4 full blocks of 4


def first_row(plans: list, request_id: str) -> tuple[int, int]:
    """(num_computed_tokens, num_scheduled_tokens) of the first plan that schedules request_id."""
    for plan in plans:
        if request_id in plan.request_ids:
            row = plan.request_ids.index(request_id)
            return int(plan.num_computed_tokens[row]), int(plan.num_scheduled_tokens[row])
    raise AssertionError(f"{request_id} was never scheduled")


def test_a_request_sharing_a_computed_prefix_computes_only_the_rest() -> None:
    harness = Harness()
    harness.add("first", SYSTEM_PROMPT + [1, 2, 3], max_tokens=3)
    harness.run()
    harness.add("second", SYSTEM_PROMPT + [7, 8], max_tokens=3)
    plans = harness.run()
    assert first_row(plans, "second") == (16, 2)
    assert harness.log.num_cached_tokens == {"first": 0, "second": 16}
    last = harness.log.messages[-1]
    assert (last.stats.prefix_cache_queries_total, last.stats.prefix_cache_hits_total) == (19 + 18, 16)


def test_hits_do_not_change_the_tokens() -> None:
    def run(enable_prefix_caching: bool) -> dict[str, list[int]]:
        harness = Harness(enable_prefix_caching=enable_prefix_caching)
        for index in range(4):
            harness.add(f"r{index}", SYSTEM_PROMPT + [index] * (index + 1), max_tokens=5)
            harness.step()
        harness.run()
        return harness.log.tokens

    assert run(True) == run(False)


def test_an_exactly_cached_prompt_recomputes_its_last_token_for_logits() -> None:
    harness = Harness()
    harness.add("first", SYSTEM_PROMPT, max_tokens=2)
    harness.run()
    harness.add("again", SYSTEM_PROMPT, max_tokens=2)
    assert first_row(harness.run(), "again") == (12, 4)  # the last full block is computed again
    assert harness.log.num_cached_tokens["again"] == 12


def test_requests_computing_the_same_prompt_at_once_both_compute_it_and_later_ones_hit() -> None:
    harness = Harness()
    harness.add("a", SYSTEM_PROMPT + [1], max_tokens=2)
    harness.add("b", SYSTEM_PROMPT + [2], max_tokens=2)
    plans = [harness.step()]
    harness.add("c", SYSTEM_PROMPT + [3], max_tokens=2)
    plans += harness.run()
    assert first_row(plans, "a") == first_row(plans, "b") == (0, 17)
    assert first_row(plans, "c") == (12, 5)  # not its last prompt token alone: see the next test


def test_a_prompt_one_past_a_cached_block_computes_a_block_more_than_its_last_token() -> None:
    """Its last token alone would be attended as a decode, in other last bits than when the whole
    prompt runs: the logits would depend on what the cache held."""
    harness = Harness()
    harness.add("first", SYSTEM_PROMPT + [5, 6], max_tokens=1)
    harness.run()
    harness.add("one_past", SYSTEM_PROMPT + [7], max_tokens=1)
    harness.add("two_past", SYSTEM_PROMPT + [8, 9], max_tokens=1)
    plans = harness.run()
    assert first_row(plans, "one_past") == (12, 5) and first_row(plans, "two_past") == (16, 2)


def test_a_preempted_request_gets_its_surviving_blocks_back_from_the_cache() -> None:
    # 5 blocks of 4: a and b (7-token prompts) fill 4; at 9 tokens each needs a third block, so b
    # is preempted with 2 full cached blocks, which survive until a finishes and b returns.
    harness = Harness(num_blocks=5, max_num_seqs=4)
    harness.add("a", [1] * 7, max_tokens=6)
    harness.add("b", [2] * 7, max_tokens=10)
    plans = harness.run()
    assert harness.engine.stats().num_preemptions_total == 1
    preempted_at = next(i for i, p in enumerate(plans) if "a" in p.request_ids and "b" not in p.request_ids)
    assert first_row(plans[preempted_at:], "b") == (8, 1)
    assert harness.log.num_cached_tokens["b"] == 0  # its first scheduling found nothing
    assert harness.log.messages[-1].stats.prefix_cache_hits_total == 8
    relaxed = Harness()
    relaxed.add("a", [1] * 7, max_tokens=6)
    relaxed.add("b", [2] * 7, max_tokens=10)
    relaxed.run()
    assert harness.log.tokens == relaxed.log.tokens


def test_without_prefix_caching_a_preempted_request_recomputes_from_the_start() -> None:
    harness = Harness(num_blocks=5, max_num_seqs=4, enable_prefix_caching=False)
    harness.add("a", [1] * 7, max_tokens=6)
    harness.add("b", [2] * 7, max_tokens=10)
    plans = harness.run()
    preempted_at = next(i for i, p in enumerate(plans) if "a" in p.request_ids and "b" not in p.request_ids)
    assert first_row(plans[preempted_at:], "b") == (0, 9)
    assert harness.log.messages[-1].stats.prefix_cache_queries_total == 0


def test_an_idle_engine_holds_no_blocks_but_keeps_them_cached() -> None:
    harness = Harness(num_blocks=16)
    for index in range(3):
        harness.add(f"r{index}", SYSTEM_PROMPT + [index], max_tokens=6)
    harness.run()
    manager = harness.engine.block_manager
    assert manager.usage == 0.0 and manager.num_free_blocks == 16
    assert manager.pool.num_cached > 0
    assert all(manager.pool.ref_count(b) == 0 for b in range(16))
    assert harness.log.messages[-1].stats.kv_cache_usage == 0.0


def test_generated_tokens_are_cached_too() -> None:
    harness = Harness()
    harness.add("a", [5] * 6, max_tokens=8)
    harness.run()
    continuation = [5] * 6 + harness.log.tokens["a"][:6]  # 12 tokens = 3 full blocks
    harness.add("b", np.asarray(continuation), max_tokens=1)
    assert first_row(harness.run(), "b") == (8, 4)
