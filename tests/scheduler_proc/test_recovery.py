"""A lost worker group (recover_lost_step): the step in flight is dropped, every running sequence
recomputes on a fresh cache, and every output equals an undisturbed run's, whatever was happening
at the time (preemptions, shared prefix-cached blocks, n > 1 siblings, chunked prefill)."""

from __future__ import annotations

import pytest

from scheduler_fakes import FakeWorker, Harness


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


@pytest.mark.parametrize("lost_after", [0, 1, 3, 6, 10, 15])
def test_outputs_after_a_lost_group_equal_an_undisturbed_run(lost_after: int) -> None:
    config = dict(max_num_seqs=4, max_num_batched_tokens=32)  # 24 blocks of 4: preemptions happen
    undisturbed = Harness(num_blocks=24, **config)
    workload(undisturbed)
    undisturbed.run()
    assert undisturbed.engine.queues.num_preemptions_total > 0

    harness = Harness(num_blocks=24, **config)
    workload(harness)
    for _ in range(lost_after):
        harness.step()
    plan = harness.engine.schedule()  # in flight when the group is lost: never applied
    assert plan is not None
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
