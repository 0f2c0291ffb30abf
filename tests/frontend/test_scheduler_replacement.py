"""The frontend's side of a replaced scheduler: each open request keeps what it has received per
choice, a new scheduler gets a hello with the next epoch and then every open request with exactly
those tokens (AddRequest.resume), outputs sent before the resubmissions (or by the lost scheduler)
are dropped, a silent scheduler is reported once, and an exited one is not alive."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import numpy as np
import pytest
import zmq

from frontend.engine_client import EngineUnavailableError, ZmqEngineClient
from frontend.engine_outputs import EngineDelta, OutputRouter
from frontend.metrics import FrontendMetrics
from proto import codec, sockets
from proto.logprobs import LogprobEntries
from proto.messages import AddRequest, FinishReason, FrontendHello, SchedulerStats, StepOutputs
from proto.sampling import SamplingParams

pytestmark = pytest.mark.anyio

PROMPT = np.array([5, 6, 7, 8], dtype=np.int32)


def outputs(rows: list[tuple[str, int, list[int], str]], pid: int = 100, epoch: int = 0,
            logprobs: LogprobEntries | None = None, num_recovered_total: int = 0) -> StepOutputs:
    """rows: (request id, choice index, new tokens, finish reason), from scheduler `pid`, whose
    num_requests_recovered_total is `num_recovered_total`."""
    lengths = [len(r[2]) for r in rows]
    return StepOutputs(
        step_id=1, request_ids=[r[0] for r in rows],
        cu_new_tokens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        new_token_ids=np.array([t for r in rows for t in r[2]], dtype=np.int32),
        finish_reasons=[FinishReason(r[3]) for r in rows], error_messages=[""] * len(rows),
        stats=SchedulerStats(len(rows), 0, 0, 0.0, 0, scheduler_pid=pid, frontend_epoch=epoch,
                             num_requests_recovered_total=num_recovered_total),
        choice_indices=np.array([r[1] for r in rows], dtype=np.int32),
        **({"logprobs": logprobs} if logprobs is not None else {}))


def add(request_id: str, n: int = 1, **params: object) -> AddRequest:
    return AddRequest(request_id, PROMPT, SamplingParams(max_tokens=8, n=n, temperature=0.0, **params), 1.0)


def drained(queue: asyncio.Queue) -> list[EngineDelta]:
    found = []
    while not queue.empty():
        found.append(queue.get_nowait())
    return found


async def test_a_resubmission_carries_each_choices_received_tokens_and_its_finished_choices():
    router = OutputRouter()
    route = router.open("r", 3, add("r", n=3))
    router.route(outputs([("r", 0, [11], ""), ("r", 1, [21], ""), ("r", 2, [31], "")]), 1.0)
    router.route(outputs([("r", 0, [12], ""), ("r", 1, [22], "stop"), ("r", 2, [32], "")]), 2.0)
    (resubmitted,) = router.resubmissions()
    resume = resubmitted.resume
    assert resubmitted.request_id == "r" and resubmitted.prompt_token_ids.tolist() == PROMPT.tolist()
    assert resume.cu_token_ids.tolist() == [0, 2, 4, 6]
    assert resume.token_ids.tolist() == [11, 12, 21, 22, 31, 32]
    assert resume.finished.tolist() == [False, True, False]
    assert codec.decode(codec.encode(resubmitted), AddRequest).resume.token_ids.tolist() == resume.token_ids.tolist()
    assert router.is_open("r") and not route.done


async def test_a_choice_the_frontend_ended_is_finished_in_the_resubmission_and_gets_its_abort_delta():
    router = OutputRouter()
    route = router.open("r", 2, add("r", n=2))
    router.route(outputs([("r", 0, [11], ""), ("r", 1, [21], "")]), 1.0)
    router.end_choice_here("r", 1)  # a stop string: the lost scheduler's "abort" never comes
    (resubmitted,) = router.resubmissions()
    assert resubmitted.resume.finished.tolist() == [False, True]
    last = drained(route.queue)[-1]
    assert (last.choice_index, last.finish_reason) == (1, FinishReason.ABORT)


async def test_a_request_with_no_choice_left_to_run_is_not_resubmitted_and_its_stream_ends():
    router = OutputRouter()
    route = router.open("r", 1, add("r"))
    router.route(outputs([("r", 0, [11], "")]), 1.0)
    router.end_choice_here("r", 0)
    assert router.resubmissions() == [] and not router.is_open("r") and route.done


async def test_prompt_logprobs_received_are_counted_so_that_none_is_sent_twice():
    router = OutputRouter()
    router.open("r", 1, add("r", prompt_logprobs=0))
    entries = LogprobEntries(rows=np.array([0, 0, 0], np.int32), positions=np.array([1, 2, 4], np.int32),
                             token_ids=np.array([6, 7, 9], np.int32), logprobs=np.zeros(3, np.float32), ranks=np.ones(3, np.int32),
                             cu_top=np.zeros(4, np.int32), top_token_ids=np.zeros(0, np.int32),
                             top_logprobs=np.zeros(0, np.float32))
    router.route(outputs([("r", 0, [9], "")], logprobs=entries), 1.0)  # position 4 is the sampled token's
    (resubmitted,) = router.resubmissions()
    assert resubmitted.resume.num_prompt_logprobs_received == 3


class Sent(list):
    def __call__(self, message: object) -> None:
        self.append(message)


def client_with_request(metrics: FrontendMetrics | None = None) -> tuple[ZmqEngineClient, Sent, object]:
    # Schedulers 100 and 200 are frames fed by hand: no process to look at.
    client, sent = ZmqEngineClient("/nonexistent", scheduler_alive=lambda pid: True), Sent()
    client._send = sent  # the transport-free client: what it would send
    if metrics is not None:
        client.add_listener(metrics)
    stream = client.generate("r", PROMPT.tolist(), SamplingParams(max_tokens=8, temperature=0.7, seed=None))
    return client, sent, stream


async def test_a_new_scheduler_gets_a_hello_then_the_request_resumed_and_stale_outputs_are_dropped():
    metrics = FrontendMetrics("tiny")
    client, sent, stream = client_with_request(metrics)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    (original,) = sent
    assert original.sampling_params.seed is not None  # drawn here, so a resubmission samples alike
    client.handle_frame(codec.encode(outputs([("r", 0, [11, 12], "")], pid=100)))
    assert (await first).token_ids == [11, 12]
    sent.clear()
    # The new scheduler's first frame: sent before it read our new hello, so its tokens are dropped.
    client.handle_frame(codec.encode(outputs([("r", 0, [99], "")], pid=200, epoch=-1)))
    hello, resubmitted = sent
    assert isinstance(hello, FrontendHello) and hello.epoch == 1
    assert resubmitted.resume.token_ids.tolist() == [11, 12]
    assert resubmitted.sampling_params.seed == original.sampling_params.seed
    assert client.recovering and not client.is_alive()
    client.handle_frame(codec.encode(outputs([("r", 0, [98], "")], pid=100)))  # the lost one's last frame
    client.handle_frame(codec.encode(outputs([("r", 0, [13], "length")], pid=200, epoch=1)))
    assert not client.recovering and client.is_alive()
    rest = [delta async for delta in stream]
    assert [d.token_ids for d in rest] == [[13]] and rest[-1].finish_reason == FinishReason.LENGTH
    assert metrics.scheduler_restarts._value.get() == 1


async def test_choices_resubmitted_to_a_new_scheduler_count_as_recovered_once_beside_worker_recoveries():
    metrics = FrontendMetrics("tiny")
    client = ZmqEngineClient("/nonexistent")
    client._send = Sent()
    client.add_listener(metrics)
    stream = client.generate("r", PROMPT.tolist(), SamplingParams(max_tokens=8, temperature=0.0, n=3))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    rows = [("r", 0, [11], ""), ("r", 1, [21], "stop"), ("r", 2, [31], "")]
    client.handle_frame(codec.encode(outputs(rows, pid=100, num_recovered_total=2)))  # a worker group lost
    assert metrics.requests_recovered._value.get() == 2
    client.handle_frame(codec.encode(outputs([], pid=200, epoch=-1, num_recovered_total=0)))
    assert metrics.requests_recovered._value.get() == 4  # choices 0 and 2 run on; choice 1 had stopped
    client.handle_frame(codec.encode(outputs([], pid=100, num_recovered_total=7)))  # the lost one, late
    client.handle_frame(codec.encode(outputs([], pid=200, epoch=1, num_recovered_total=0)))
    assert metrics.requests_recovered._value.get() == 4
    client.handle_frame(codec.encode(outputs([], pid=200, epoch=1, num_recovered_total=1)))  # its own group lost
    assert metrics.requests_recovered._value.get() == 5
    assert metrics.scheduler_restarts._value.get() == 1
    first.cancel()


async def test_requests_that_could_not_be_resubmitted_fail_and_are_not_counted_as_recovered():
    metrics = FrontendMetrics("tiny")
    client = ZmqEngineClient("/nonexistent")

    def refuse_resubmissions(message: object) -> None:
        if isinstance(message, AddRequest) and message.resume is not None:
            raise EngineUnavailableError("the scheduler is not accepting requests (inbox full)")

    client._send = refuse_resubmissions
    client.add_listener(metrics)
    stream = client.generate("r", PROMPT.tolist(), SamplingParams(max_tokens=8, temperature=0.0))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    client.handle_frame(codec.encode(outputs([], pid=100)))
    client.handle_frame(codec.encode(outputs([], pid=200, epoch=-1)))
    failed = await first
    assert failed.finish_reason == FinishReason.ERROR and "could not resubmit" in failed.error_message
    assert metrics.requests_recovered._value.get() == 0 and metrics.scheduler_restarts._value.get() == 1


async def test_a_silent_scheduler_is_reported_once_and_the_requests_are_held():
    reports = []
    client = ZmqEngineClient("/nonexistent", hang_after_s=0.0, on_scheduler_hung=lambda *a: reports.append(a))
    client._send = Sent()
    stream = client.generate("r", PROMPT.tolist(), SamplingParams(max_tokens=8, temperature=0.0))
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    client.handle_frame(codec.encode(outputs([], pid=100)))
    client.report_hung_scheduler()
    client.report_hung_scheduler()
    assert [pid for pid, _ in reports] == [100] and "heard nothing" in reports[0][1]
    assert client.recovering and client.num_in_flight == 1
    client.fail_silent_requests()  # dead_after_s (the whole restart's bound) has not passed
    assert not pending.done()
    pending.cancel()


async def test_thousands_of_open_requests_are_all_resubmitted_to_a_scheduler_not_yet_reading():
    """ZeroMQ's default queue (1000 frames a side) would refuse most of them: the requests
    channel is uncapped, admission bounds it."""
    runtime_dir = sockets.make_runtime_dir()
    context = zmq.Context()
    scheduler_inbox = sockets.bind(context, zmq.PULL, runtime_dir, sockets.REQUESTS)
    client = ZmqEngineClient(runtime_dir)
    try:
        await client.start()
        num_requests = 5000
        streams = [client.generate(f"r{i}", PROMPT.tolist(), SamplingParams(max_tokens=8, temperature=0.0))
                   for i in range(num_requests)]
        firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
        await asyncio.sleep(0)  # each stream sends its AddRequest
        client.handle_frame(codec.encode(outputs([], pid=100)))
        client.handle_frame(codec.encode(outputs([], pid=200, epoch=-1)))  # a new scheduler
        assert not any(first.done() for first in firsts), "a resubmission failed"
        received = [codec.decode(sockets.recv_ready(scheduler_inbox, 5.0), sockets.REQUEST_MESSAGES)
                    for _ in range(2 + 2 * num_requests)]  # two hellos
        resubmitted = [m.request_id for m in received if isinstance(m, AddRequest) and m.resume is not None]
        assert sorted(resubmitted) == sorted(f"r{i}" for i in range(num_requests))
        for first in firsts:
            first.cancel()
    finally:
        await client.close()
        context.destroy(linger=0)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_a_scheduler_whose_process_exited_is_not_alive_before_its_silence_says_so():
    """A killed scheduler sends nothing: /health must not wait out alive_timeout_s to turn 503."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        client = ZmqEngineClient("/nonexistent", alive_timeout_s=60.0)
        client.handle_frame(codec.encode(outputs([], pid=sleeper.pid)))
        assert client.is_alive()
        sleeper.kill()
        sleeper.wait()
        assert not client.is_alive()
    finally:
        sleeper.kill()
        sleeper.wait()
