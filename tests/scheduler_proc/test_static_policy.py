"""Static batching (for comparison): padded seats, no admission while a batch runs, same tokens."""

from __future__ import annotations

from scheduler_fakes import Harness


def add_mixed_lengths(harness: Harness) -> None:
    harness.add("short", 5, max_tokens=2)
    harness.add("long", 6, max_tokens=6)
    harness.add("late", 4, max_tokens=3)


def test_static_batch_keeps_finished_seats_and_still_computes_them() -> None:
    harness = Harness(scheduling="static", max_num_seqs=2)
    add_mixed_lengths(harness)
    plans = harness.run()
    # Batch 1 = short + long for 6 steps; short finished after step 2 but stays in every plan.
    first_batch = plans[:6]
    assert all(sorted(p.request_ids) == ["long", "short"] for p in first_batch)
    for plan in first_batch[2:]:
        row = plan.request_ids.index("short")
        assert int(plan.num_scheduled_tokens[row]) == 1 and bool(plan.sample_mask[row])
    assert harness.engine.num_padded_seat_steps_total == 4  # late runs alone: no padding
    assert harness.log.messages[-1].stats.num_padded_slot_steps_total == 4
    assert all(p.request_ids == ["late"] for p in plans[6:])
    assert harness.log.tokens["short"] == harness.worker.sequences["short"][5:]
    assert len(harness.log.tokens["short"]) == 2


def test_static_batch_admits_nothing_until_its_longest_member_ends() -> None:
    harness = Harness(scheduling="static", max_num_seqs=2)
    add_mixed_lengths(harness)
    for _ in range(6):
        assert "late" not in harness.step().request_ids
    assert harness.step().request_ids == ["late"]


def test_continuous_admits_in_the_same_step_a_seat_frees() -> None:
    harness = Harness(max_num_seqs=2)
    add_mixed_lengths(harness)
    harness.step()
    harness.step()  # short finishes here
    assert harness.log.finish_reasons == {"short": "length"}
    assert harness.step().request_ids == ["long", "late"]


def test_static_and_continuous_give_identical_token_streams() -> None:
    streams = {}
    for scheduling in ("static", "continuous"):
        harness = Harness(scheduling=scheduling, max_num_seqs=3, max_num_batched_tokens=12)
        for index in range(7):
            harness.add(f"r{index}", 3 + 2 * index, max_tokens=2 + (5 * index) % 7)
        harness.run()
        streams[scheduling] = (harness.log.tokens, harness.log.finish_reasons)
    assert streams["static"] == streams["continuous"]


def test_padding_seats_never_starve_live_members_of_the_token_budget() -> None:
    harness = Harness(scheduling="static", max_num_seqs=2, max_num_batched_tokens=1)
    harness.add("a", 1, max_tokens=1)
    harness.add("b", 1, max_tokens=1)
    harness.run(max_steps=10)
    assert harness.log.finish_reasons == {"a": "length", "b": "length"}


def test_static_batch_reserves_kv_up_front_and_never_preempts() -> None:
    # 8 blocks of 4 tokens: each request may need 5 blocks (8 prompt + 12 max_tokens - 1 = 19 tokens).
    harness = Harness(num_blocks=8, scheduling="static", max_num_seqs=4)
    for request_id in ("a", "b", "c"):
        harness.add(request_id, 8, max_tokens=12)
    plans = harness.run()
    assert harness.engine.stats().num_preemptions_total == 0
    assert max(p.num_seqs for p in plans) == 1  # only one request's reservation fits at a time
    assert set(harness.log.finish_reasons.values()) == {"length"}


def test_aborting_a_static_member_keeps_its_seat_until_the_batch_ends() -> None:
    harness = Harness(scheduling="static", max_num_seqs=2)
    harness.add("a", 4, max_tokens=5)
    harness.add("b", 4, max_tokens=5)
    harness.step()
    harness.abort("a")
    assert sorted(harness.step().request_ids) == ["a", "b"]  # a's seat still computes (padding)
    harness.run()
    assert harness.log.finish_reasons == {"a": "abort", "b": "length"}
    assert harness.engine.block_manager.num_free_blocks == 64
