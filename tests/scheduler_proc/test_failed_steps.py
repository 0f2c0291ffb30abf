"""A worker that raised in a step (recover_failed_step): the group is replaced, the step's members
are recomputed one at a time, and only an input that raises again, alone, ends with "error"."""

from __future__ import annotations

import pytest
from test_recovery import fresh_worker, workload

from scheduler_fakes import Harness
from scheduler_proc.engine import MAX_FAILED_STEPS
from scheduler_proc.request import Request

CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=32)  # 24 blocks of 4: preemptions happen


def live(harness: Harness) -> list[Request]:
    return [*harness.engine.queues.waiting, *harness.engine.queues.running]


def fail_step(harness: Harness, error: str = "boom") -> list[str]:
    """Schedule a step, let it fail, and give the harness a fresh worker; the step's members."""
    plan = harness.engine.schedule()
    assert plan is not None
    harness.log.record(harness.engine.recover_failed_step(error))
    harness.engine.check_invariants()
    harness.worker = fresh_worker(harness.worker, harness, harness.engine.block_manager.num_blocks)
    return list(plan.request_ids)


@pytest.mark.parametrize("failed_after", [0, 2, 6, 11])
def test_outputs_after_a_failed_step_equal_an_undisturbed_run_and_its_members_sample_alone(
        failed_after: int) -> None:
    undisturbed = Harness(num_blocks=24, **CONFIG)
    workload(undisturbed)
    undisturbed.run()

    harness = Harness(num_blocks=24, **CONFIG)
    workload(harness)
    for _ in range(failed_after):
        harness.step()
    members = fail_step(harness)
    assert {r.label for r in live(harness) if r.solo_owed} == set(members)
    assert harness.engine.block_manager.num_free_blocks == 24
    while any(r.solo_owed for r in live(harness)):
        owing = {r.label for r in live(harness) if r.solo_owed}
        plan = harness.step()
        assert plan is not None
        if any(label in owing for label in plan.request_ids):
            assert plan.num_seqs == 1, f"{plan.request_ids} ran together with one that owes a solo step"
    harness.run()
    assert harness.log.finish_reasons == undisturbed.log.finish_reasons
    assert harness.log.tokens == undisturbed.log.tokens


def test_a_request_whose_step_fails_again_alone_ends_with_error_and_the_others_finish() -> None:
    undisturbed = Harness(num_blocks=64, **CONFIG)
    for request_id in "abc":
        undisturbed.add(request_id, 12, max_tokens=6)
    undisturbed.run()

    harness = Harness(num_blocks=64, **CONFIG)
    for request_id in "abc":
        harness.add(request_id, 12, max_tokens=6)
    harness.step()
    assert sorted(fail_step(harness, "first")) == ["a", "b", "c"]
    for _ in range(100):  # "b" raises whenever it is in a step: its solo step fails too
        plan = harness.engine.schedule()
        if plan is None:
            break
        if "b" in plan.request_ids:
            assert plan.request_ids == ["b"]
            harness.log.record(harness.engine.recover_failed_step("worker step failed: ValueError: bad"))
            harness.worker = fresh_worker(harness.worker, harness, 64)
        else:
            harness.log.record(harness.engine.apply_result(harness.worker(plan)))
        harness.engine.check_invariants()
    assert not harness.engine.has_unfinished_requests
    assert harness.log.finish_reasons == {"a": "length", "b": "error", "c": "length"}
    assert "failed 2 steps with this request in them, the last one alone" in harness.log.error_messages["b"]
    assert "ValueError: bad" in harness.log.error_messages["b"]
    assert harness.log.tokens["a"] == undisturbed.log.tokens["a"]
    assert harness.log.tokens["c"] == undisturbed.log.tokens["c"]
    assert harness.engine.block_manager.num_free_blocks == 64


def test_a_request_in_max_failed_steps_ends_with_error_even_if_it_never_failed_alone() -> None:
    harness = Harness(num_blocks=64, **CONFIG)
    for request_id in "ab":
        harness.add(request_id, 8, max_tokens=20)
    for failure in range(1, MAX_FAILED_STEPS + 1):
        while any(r.solo_owed for r in live(harness)):  # both sample alone, then run together
            harness.step()
        harness.step()
        assert sorted(fail_step(harness)) == ["a", "b"]
        expected = "error" if failure == MAX_FAILED_STEPS else None
        assert harness.log.finish_reasons.get("a") == expected and harness.log.finish_reasons.get("b") == expected
    assert f"failed {MAX_FAILED_STEPS} steps with this request in them: boom" in harness.log.error_messages["a"]
    assert not harness.engine.has_unfinished_requests and harness.engine.block_manager.num_free_blocks == 64


def test_waiting_requests_are_not_admitted_past_one_that_owes_a_solo_step() -> None:
    harness = Harness(num_blocks=64, **CONFIG)
    harness.add("a", 8, max_tokens=10)
    harness.step()
    fail_step(harness)
    harness.add("late", 8, max_tokens=10)
    plan = harness.step()
    assert plan is not None and plan.request_ids == ["a"]  # the owing one alone, "late" behind it
    assert not harness.engine.queues.running[0].solo_owed  # it sampled: it batches again
    plan = harness.step()
    assert plan is not None and sorted(plan.request_ids) == ["a", "late"]
    harness.run()
    assert harness.log.finish_reasons == {"a": "length", "late": "length"}


@pytest.mark.parametrize("caching", [dict(enable_prefix_caching=False), dict(prompt_logprobs=1)])
def test_a_solo_recompute_that_needs_the_blocks_others_hold_waits_for_them_and_never_preempts_itself(
        caching: dict) -> None:
    """b's recompute needs 15 of 16 blocks while a holds some: admitted in chunks, b would preempt
    itself (the newest) at its next chunk and start over for ever. It waits until a is done."""
    config, params = dict(max_num_seqs=4, max_num_batched_tokens=16), {}
    if "enable_prefix_caching" in caching:
        config.update(caching)
    else:
        params.update(caching)
    undisturbed = Harness(num_blocks=16, **config)
    undisturbed.add("a", 8, max_tokens=4)
    undisturbed.add("b", 60, max_tokens=2, **params)
    undisturbed.run()

    harness = Harness(num_blocks=16, **config)
    harness.add("a", 8, max_tokens=4)
    harness.add("b", 60, max_tokens=2, **params)
    while not {"a", "b"} <= {r.label for r in harness.engine.queues.running}:
        harness.step()
    assert sorted(fail_step(harness)) == ["a", "b"]
    harness.run(max_steps=200)
    assert harness.log.finish_reasons == undisturbed.log.finish_reasons == {"a": "length", "b": "length"}
    assert harness.log.tokens == undisturbed.log.tokens
