"""The OutputRouter sends each StepOutputs row to its (request, choice), with its logprob entries."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from frontend.engine_outputs import EngineDelta, OutputRouter, TokenLogprob
from proto.logprobs import LogprobEntries
from proto.messages import ERROR_NONE, ERROR_QUEUE_FULL, SchedulerStats, StepOutputs

pytestmark = pytest.mark.anyio


def outputs(rows: list[tuple[str, int, list[int], str]], **fields: object) -> StepOutputs:
    """rows: (request id, choice index, new tokens, finish reason)."""
    lengths = [len(r[2]) for r in rows]
    return StepOutputs(
        step_id=1, request_ids=[r[0] for r in rows],
        cu_new_tokens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        new_token_ids=np.array([t for r in rows for t in r[2]], dtype=np.int32),
        finish_reasons=[r[3] for r in rows], error_messages=[""] * len(rows),
        stats=SchedulerStats(len(rows), 0, 0, 0.0, 0),
        choice_indices=np.array([r[1] for r in rows], dtype=np.int32), **fields)


async def collect(router: OutputRouter, request_id: str, num_choices: int,
                  messages: list[StepOutputs]) -> list[EngineDelta]:
    route = router.open(request_id, num_choices)
    for message in messages:
        router.route(message, 5.0)
    return [delta async for delta in route.deltas()]


async def test_rows_reach_their_choice_with_their_logprob_entries_and_cache_hits():
    entries = LogprobEntries(rows=np.array([0, 0], np.int32), positions=np.array([3, 4], np.int32),
                             token_ids=np.array([9, 8], np.int32), logprobs=np.array([-0.5, -1.5], np.float32),
                             ranks=np.array([1, 2], np.int32),
                             cu_top=np.array([0, 1, 2], np.int32), top_token_ids=np.array([9, 8], np.int32),
                             top_logprobs=np.array([-0.5, -1.5], np.float32))
    logprobs = dict(logprobs=entries, num_cached_tokens=np.array([16, 0, 0], np.int32))
    message = outputs([("a", 1, [9], ""), ("a", 0, [7], "length"), ("b", 0, [1], "")], **logprobs)
    router = OutputRouter()
    other = router.open("b", 1)
    deltas = await collect(router, "a", 2, [message, outputs([("a", 1, [8], "stop")])])
    assert deltas == [EngineDelta([9], choice_index=1, num_cached_tokens=16,
                                  logprobs=(TokenLogprob(3, 9, -0.5, ((9, -0.5),), rank=1),
                                            TokenLogprob(4, 8, -1.5, ((8, -1.5),), rank=2))),
                      EngineDelta([7], "length", choice_index=0),
                      EngineDelta([8], "stop", choice_index=1)]
    assert deltas[0].received_s == 5.0
    assert other.queue.qsize() == 1 and len(router) == 1  # "a" is done, "b" still runs


async def test_an_error_code_reaches_its_choice_by_name():
    message = outputs([("a", 0, [], "error"), ("a", 1, [], "error")],
                      error_codes=np.array([ERROR_QUEUE_FULL, ERROR_NONE], np.uint8))
    deltas = await collect(OutputRouter(), "a", 2, [message])
    assert [(d.choice_index, d.error_code) for d in deltas] == [(0, "queue_full"), (1, "")]


async def test_abort_ends_only_the_choices_still_open():
    router = OutputRouter()
    route = router.open("a", 3)
    router.route(outputs([("a", 1, [4], "stop")]), 1.0)
    assert router.abort("a") and not router.abort("a")
    deltas = [delta async for delta in route.deltas()]
    assert [(d.choice_index, d.finish_reason) for d in deltas] == [(1, "stop"), (0, "abort"), (2, "abort")]


async def test_outputs_for_a_choice_the_request_does_not_have_are_dropped():
    router = OutputRouter()
    route = router.open("a", 1)
    router.route(outputs([("a", 3, [4], "stop"), ("a", 0, [5], "stop")]), 1.0)
    assert [delta.token_ids async for delta in route.deltas()] == [[5]]


async def test_listeners_see_every_message_even_for_requests_no_longer_routed():
    seen: list[int] = []

    class Listener:
        def on_step_outputs(self, message: StepOutputs) -> None:
            seen.append(message.step_id)

        def on_protocol_error(self) -> None:
            seen.append(-99)

    router = OutputRouter()
    router.add_listener(Listener())
    seventh = dataclasses.replace(outputs([("gone", 0, [1], "")]), step_id=7,
                                  stats=SchedulerStats(7, 0, 0, 0.0, 0))
    router.route(seventh, 1.0)
    router.protocol_error()
    assert seen == [7, -99] and router.latest_stats == seventh.stats


async def test_outputs_of_requests_not_in_flight_here_are_dropped_and_counted():
    router = OutputRouter()
    # e.g. an earlier frontend's requests, still in the scheduler's queue when this one started
    deltas = await collect(router, "mine", 1, [outputs([("earlier", 0, [3], "abort"), ("mine", 0, [4], ""),
                                                        ("earlier-2", 0, [5], "")]),
                                               outputs([("mine", 0, [6], "length")])])
    assert [d.token_ids for d in deltas] == [[4], [6]]
    assert router.num_unknown_outputs == 2 and len(router) == 0
