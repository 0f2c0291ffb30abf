"""Continuous batching: admission, token budget, chunked prefill, seats and preemption."""

from __future__ import annotations

import pytest
from scheduler_fakes import Harness, default_token

from scheduler_proc.policy import without_lone_query


def expected_tokens(request_id: str, num_prompt: int, num_output: int) -> list[int]:
    return [default_token(request_id, num_prompt + k) for k in range(num_output)]


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    harness = Harness(max_num_seqs=2)
    for request_id in ("a", "b", "c", "d"):
        harness.add(request_id, 5, max_tokens=3)
    first = harness.step()
    assert first.request_ids == ["a", "b"]
    plans = harness.run()
    order = []
    for plan in [first, *plans]:
        order += [rid for rid in plan.request_ids if rid not in order]
    assert order == ["a", "b", "c", "d"]


def test_finished_request_frees_its_blocks_before_next_step() -> None:
    harness = Harness(num_blocks=8, max_num_seqs=4)
    harness.add("short", 4, max_tokens=1)
    harness.step()
    assert harness.log.finish_reasons["short"] == "length"
    assert harness.engine.block_manager.num_free_blocks == 8
    assert harness.engine.stats().kv_cache_usage == 0.0


def test_a_freed_seat_is_taken_in_the_same_step_it_frees() -> None:
    harness = Harness(max_num_seqs=1)
    harness.add("a", 4, max_tokens=2)
    harness.add("b", 4, max_tokens=2)
    harness.step()  # a: prefill + first token
    harness.step()  # a: second token, finishes
    assert harness.log.finish_reasons == {"a": "length"}
    assert harness.step().request_ids == ["b"]


def test_token_budget_is_respected_every_step() -> None:
    harness = Harness(max_num_batched_tokens=16, max_num_seqs=8)
    for index in range(6):
        harness.add(f"r{index}", 7 + index, max_tokens=5)
    plans = harness.run()  # the harness asserts the budget on every plan
    assert max(int(p.num_scheduled_tokens.sum()) for p in plans) == 16
    assert all(len(harness.log.tokens[f"r{index}"]) == 5 for index in range(6))


def test_long_prompt_is_chunked_and_the_chunks_add_up_to_the_prompt() -> None:
    harness = Harness(max_num_batched_tokens=8)
    harness.add("long", 30, max_tokens=2)
    plans = harness.run()
    chunks = [(int(p.num_computed_tokens[0]), int(p.num_scheduled_tokens[0])) for p in plans]
    assert chunks[:4] == [(0, 8), (8, 8), (16, 8), (24, 6)]
    assert [bool(p.sample_mask[0]) for p in plans] == [False, False, False, True, True]
    assert harness.log.tokens["long"] == expected_tokens("long", 30, 2)


def test_a_prompt_is_never_cut_into_a_lone_token() -> None:
    """The attention kernel takes a member's only query in a step for a decode: a prompt cut so
    that one of its tokens runs alone would get other last bits than when it runs whole."""
    harness = Harness(max_num_batched_tokens=8)
    harness.add("long", 17, max_tokens=2)  # 8 + 8 + 1 would leave its last token alone
    plans = harness.run()
    chunks = [(int(p.num_computed_tokens[0]), int(p.num_scheduled_tokens[0])) for p in plans]
    assert chunks[:3] == [(0, 8), (8, 7), (15, 2)]
    assert harness.log.tokens["long"] == expected_tokens("long", 17, 2)


def test_a_prompt_that_would_get_one_token_of_the_budget_waits_for_the_next_step() -> None:
    harness = Harness(max_num_batched_tokens=10)
    for request_id in ("a", "b", "c"):
        harness.add(request_id, 3, max_tokens=4)
    harness.step()  # 9 of 10
    harness.add("d", 5, max_tokens=1)
    plan = harness.step()  # 3 decodes leave 7: d runs whole
    assert plan.request_ids == ["a", "b", "c", "d"] and plan.num_scheduled_tokens.tolist() == [1, 1, 1, 5]
    harness = Harness(max_num_batched_tokens=10)
    harness.add("e", 9, max_tokens=3)
    harness.add("f", [7, 8, 9, 10, 11, 12], max_tokens=1)  # nothing of it in the prefix cache
    first = harness.step()  # e 9, and f would get 1 of its 6 (leaving 5): it waits
    assert first.request_ids == ["e"]
    assert harness.step().num_scheduled_tokens.tolist() == [1, 6]


@pytest.mark.parametrize(("budget", "num_remaining", "most", "expected"), [
    (8, 8, 8, 8), (8, 9, 8, 7), (2, 3, 8, 0), (1, 5, 8, 0), (1, 1, 8, 1), (5, 9, 8, 5),
    (2, 3, 2, 2), (1, 5, 2, 1)])  # most < 3: lone tokens cannot be avoided, the cut stands
def test_a_chunk_neither_is_nor_leaves_a_lone_token(budget: int, num_remaining: int, most: int,
                                                    expected: int) -> None:
    assert without_lone_query(num_remaining, budget, most) == expected


def test_decodes_go_first_and_prefill_gets_the_rest_of_the_budget() -> None:
    harness = Harness(max_num_batched_tokens=10)
    harness.add("a", 3, max_tokens=10)
    harness.step()
    harness.add("b", 20, max_tokens=2)
    plan = harness.step()
    assert plan.request_ids == ["a", "b"]
    assert plan.num_scheduled_tokens.tolist() == [1, 9]


def test_seat_limit_caps_the_running_set_at_every_step() -> None:
    harness = Harness(max_num_seqs=3)
    for index in range(7):
        harness.add(f"r{index}", 3, max_tokens=2 + index % 3)  # seats free on different steps
    while True:
        num_unfinished = 7 - len(harness.log.finish_reasons)
        plan = harness.step()
        if plan is None:
            break
        # every seat that has a request to hold is taken, and never a fourth
        assert plan.num_seqs == min(3, num_unfinished)
        assert harness.engine.stats().num_running <= 3
    assert len(harness.log.finish_reasons) == 7


def test_kv_pressure_preempts_the_most_recently_admitted_request_to_the_head_of_waiting() -> None:
    # 6 blocks of 4 tokens: three requests of 8 prompt tokens fill them; the first decode overflows.
    harness = Harness(num_blocks=6, max_num_seqs=4)
    for request_id in ("a", "b", "c", "d"):
        harness.add(request_id, 8, max_tokens=6)
    harness.step()  # a, b, c prefilled; d waits for blocks
    assert [r.request_id for r in harness.engine.queues.waiting] == ["d"]
    plan = harness.step()  # a needs a block: c (newest) is preempted, b too, until a and b fit
    waiting = [r.request_id for r in harness.engine.queues.waiting]
    assert waiting[0] == "c" and waiting[-1] == "d"
    assert "c" not in plan.request_ids
    assert harness.engine.stats().num_preemptions_total >= 1
    request_c = harness.engine.get_request("c")
    assert request_c.num_computed_tokens == 0 and request_c.num_output_tokens == 1
    harness.run()


def test_preempted_requests_recompute_and_produce_the_same_tokens_as_without_pressure() -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        harness = Harness(num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=20)
        for index in range(6):
            harness.add(f"r{index}", 5 + 3 * index, max_tokens=12)
        harness.run()
        assert set(harness.log.finish_reasons.values()) == {"length"}
        return harness.log.tokens, harness.engine.stats().num_preemptions_total

    relaxed, relaxed_preemptions = run(num_blocks=200)
    pressured, pressured_preemptions = run(num_blocks=9)
    assert relaxed_preemptions == 0 and pressured_preemptions > 0
    assert pressured == relaxed
    assert relaxed["r2"] == expected_tokens("r2", 11, 12)


def test_nothing_is_admitted_in_a_step_that_preempted() -> None:
    harness = Harness(num_blocks=4, max_num_seqs=4)
    harness.add("a", 8, max_tokens=8)
    harness.add("b", 8, max_tokens=8)
    harness.step()
    harness.add("c", 1, max_tokens=1)
    plan = harness.step()  # a needs a third block: b is preempted; c must not jump in
    assert plan.request_ids == ["a"]
    assert [r.request_id for r in harness.engine.queues.waiting] == ["b", "c"]
    harness.run()
    assert harness.log.finish_reasons == {"a": "length", "b": "length", "c": "length"}
