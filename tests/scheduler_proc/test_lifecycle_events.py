"""Lifecycle events (queued, scheduled, first token, preempted, finished) and cache stats in StepOutputs.

The OutputLog already checks the order rules on every message; these tests pin the specifics.
"""

from __future__ import annotations

import time

from proto.messages import (EVENT_FINISHED, EVENT_FIRST_TOKEN, EVENT_PREEMPTED, EVENT_QUEUED,
                            EVENT_SCHEDULED)
from scheduler_fakes import Harness


def event_times(harness: Harness, key: str) -> list[tuple[int, float]]:
    """(kind, scheduler wall time) of every event of a choice, in order."""
    request_id, _, choice = key.partition("#")
    found = []
    for message in harness.log.messages:
        for rid, c, kind, t in zip(message.events.request_ids, message.events.choice_indices.tolist(),
                                   message.events.kinds.tolist(), message.events.times_s.tolist()):
            if rid == request_id and c == int(choice or 0):
                found.append((kind, t))
    return found


def test_a_request_is_queued_scheduled_gets_a_first_token_and_finishes_at_wall_clock_times() -> None:
    harness = Harness(max_num_batched_tokens=4)
    before = time.time()
    harness.add("a", 10, max_tokens=3)
    harness.run()
    events = event_times(harness, "a")
    assert [kind for kind, _ in events] == [EVENT_QUEUED, EVENT_SCHEDULED, EVENT_FIRST_TOKEN, EVENT_FINISHED]
    times = [t for _, t in events]
    assert before <= times[0] and times == sorted(times) and times[-1] <= time.time()


def test_steps_without_tokens_still_carry_their_events() -> None:
    harness = Harness(max_num_batched_tokens=4)
    harness.add("a", 10, max_tokens=3)
    harness.step()  # a prefill chunk: no token yet
    first = harness.log.messages[-1]
    assert first.num_outputs == 0 and first.events.kinds.tolist() == [EVENT_QUEUED, EVENT_SCHEDULED]
    assert first.num_scheduled_tokens == 4


def test_each_preemption_is_an_event_and_scheduled_is_reported_only_once() -> None:
    harness = Harness(num_blocks=6, max_num_seqs=4)
    for request_id in ("a", "b", "c"):
        harness.add(request_id, 8, max_tokens=6)
    harness.run()
    kinds = {key: [kind for kind, _ in event_times(harness, key)] for key in ("a", "b", "c")}
    num_preempted = sum(k.count(EVENT_PREEMPTED) for k in kinds.values())
    assert num_preempted == harness.engine.stats().num_preemptions_total > 0
    assert all(k.count(EVENT_SCHEDULED) == 1 and k[-1] == EVENT_FINISHED for k in kinds.values())


def test_every_choice_has_its_own_events_and_rejected_requests_only_finish() -> None:
    harness = Harness(max_model_len=16)
    harness.add("a", 6, max_tokens=2, n=2)
    harness.add("too-long", 17, max_tokens=1, n=2)
    harness.run()
    assert [k for k, _ in event_times(harness, "a#1")] == [
        EVENT_QUEUED, EVENT_SCHEDULED, EVENT_FIRST_TOKEN, EVENT_FINISHED]
    assert [k for k, _ in event_times(harness, "too-long#1")] == [EVENT_FINISHED]
    assert harness.log.finish_reasons["too-long#1"] == "error"


def test_an_aborted_waiting_request_is_queued_then_finished() -> None:
    harness = Harness(max_num_seqs=1)
    harness.add("a", 4, max_tokens=3)
    harness.add("b", 4, max_tokens=3)
    harness.step()
    harness.abort("b")
    harness.run()
    assert [k for k, _ in event_times(harness, "b")] == [EVENT_QUEUED, EVENT_FINISHED]
