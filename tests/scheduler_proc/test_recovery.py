"""A lost worker group (recover_lost_step): the step in flight is dropped, every running sequence
recomputes on a fresh cache, and every output equals an undisturbed run's, whatever was happening
at the time (preemptions, shared prefix-cached blocks, n > 1 siblings, chunked prefill)."""

from __future__ import annotations

from collections import Counter

import pytest

from scheduler_fakes import FakeWorker, Harness
from scheduler_proc.engine import SchedulerEngine

PREEMPTING = "a request preempted in the lost step"
SHARING = "prefix-cached blocks shared by running requests"
SIBLINGS = "an n > 1 request with several choices running"

# Steps run before the lost one, and what the lost step holds at that point of the workload
# (checked in the test, so a change of scheduling cannot make a situation vanish unnoticed).
FAULT_POINTS = [(0, set()), (1, {SHARING}), (2, {PREEMPTING, SHARING}), (3, {SHARING}), (6, {SHARING}),
                (10, {SHARING}), (11, {SHARING, SIBLINGS}), (15, {SHARING, SIBLINGS})]


def workload(harness: Harness) -> None:
    shared = list(range(100, 140))  # 40 tokens: two full blocks of 16... of 4 here, shared
    harness.add("a", shared + [7, 8, 9], max_tokens=12)
    harness.add("b", shared + [5], max_tokens=9)
    harness.add("c", 30, max_tokens=10, n=3, temperature=0.8, seed=5)
    harness.add("d", 70, max_tokens=6)  # a prompt over several chunks
    harness.add("e", 9, max_tokens=14, ignore_eos=True)


def fresh_worker(lost: FakeWorker, harness: Harness, num_blocks: int) -> FakeWorker:
    """The replacement group: an empty cache, the same expectations of every sequence so far."""
    worker = FakeWorker(num_blocks, harness.config.block_size)
    worker.sequences = {key: list(tokens) for key, tokens in lost.sequences.items()}
    worker.prompt_lengths = dict(lost.prompt_lengths)
    return worker


def situations_in_flight(engine: SchedulerEngine, num_preemptions_before: int) -> set[str]:
    """Which of PREEMPTING, SHARING, SIBLINGS hold for the step just scheduled (not yet applied)."""
    situations = {PREEMPTING} if engine.queues.num_preemptions_total > num_preemptions_before else set()
    pool = engine.block_manager.pool
    block_ids = {b for request in engine.queues.running for b in request.block_ids.tolist()}
    if any(pool.ref_count(b) > 1 and pool.key_of(b) is not None for b in block_ids):
        situations.add(SHARING)
    if max(Counter(r.request_id for r in engine.queues.running).values(), default=0) > 1:
        situations.add(SIBLINGS)
    return situations


def test_the_fault_points_cover_a_preemption_shared_blocks_and_running_siblings() -> None:
    assert set().union(*(expected for _, expected in FAULT_POINTS)) == {PREEMPTING, SHARING, SIBLINGS}


@pytest.mark.parametrize("lost_after, expected", FAULT_POINTS)
def test_outputs_after_a_lost_group_equal_an_undisturbed_run(lost_after: int, expected: set[str]) -> None:
    config = dict(max_num_seqs=4, max_num_batched_tokens=32)  # 24 blocks of 4: preemptions happen
    undisturbed = Harness(num_blocks=24, **config)
    workload(undisturbed)
    undisturbed.run()
    assert undisturbed.engine.queues.num_preemptions_total > 0

    harness = Harness(num_blocks=24, **config)
    workload(harness)
    for _ in range(lost_after):
        harness.step()
    num_preemptions_before = harness.engine.queues.num_preemptions_total
    plan = harness.engine.schedule()  # in flight when the group is lost: never applied
    assert plan is not None
    assert expected <= situations_in_flight(harness.engine, num_preemptions_before)
    running = len(harness.engine.queues.running)
    outputs = harness.engine.recover_lost_step()
    harness.log.record(outputs)
    harness.engine.check_invariants()
    assert outputs.stats.num_running == 0 and outputs.stats.num_requests_recovered_total == running
    assert harness.engine.block_manager.num_free_blocks == 24
    assert harness.engine.block_manager.pool.num_cached == 0  # the lost cache's blocks are gone
    harness.worker = fresh_worker(harness.worker, harness, 24)
    harness.run()
    assert harness.log.finish_reasons == undisturbed.log.finish_reasons
    assert harness.log.tokens == undisturbed.log.tokens


def test_a_static_batch_gives_back_its_padded_seats_when_its_group_is_lost() -> None:
    harness = Harness(num_blocks=64, scheduling="static", max_num_seqs=3)
    harness.add("short", 5, max_tokens=2)
    harness.add("long", 5, max_tokens=8)
    for _ in range(4):  # "short" has finished and holds its seat as padding
        harness.step()
    assert harness.log.finish_reasons.get("short") == "length"
    harness.engine.schedule()
    harness.engine.recover_lost_step()
    harness.engine.check_invariants()
    assert harness.engine.block_manager.num_free_blocks == 64
    harness.worker = fresh_worker(harness.worker, harness, 64)
    harness.run()
    assert harness.log.finish_reasons == {"short": "length", "long": "length"}
    assert len(harness.log.tokens["long"]) == 8
