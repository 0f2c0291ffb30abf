"""ZmqEngineClient over real ipc sockets against a fake scheduler thread."""

from __future__ import annotations

import asyncio
import os

import pytest

from frontend.engine_client import EngineDelta, ZmqEngineClient
from proto.messages import AbortRequest, AddRequest, FrontendHello
from proto.sampling import SamplingParams

pytestmark = pytest.mark.anyio


async def collect(stream) -> list[EngineDelta]:
    return [delta async for delta in stream]


async def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture
async def engine_client(runtime_dir):
    client = ZmqEngineClient(runtime_dir, alive_timeout_s=0.2, dead_after_s=0.5)
    await client.start()
    yield client
    await client.close()


async def test_generate_round_trips_through_a_scheduler(fake_scheduler, engine_client):
    await wait_until(engine_client.is_alive)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    stream = engine_client.generate("cmpl-1", [5, 6, 7], params)
    deltas = await asyncio.wait_for(collect(stream), 5)
    assert deltas == [EngineDelta([8]), EngineDelta([9], "length")]
    added = fake_scheduler.received[0]
    assert isinstance(added, AddRequest) and added.request_id == "cmpl-1"
    assert added.prompt_token_ids.tolist() == [5, 6, 7] and added.sampling_params == params
    assert engine_client.num_protocol_errors == 1  # the scheduler's garbage frame, survived
    assert engine_client.latest_stats is not None and engine_client.num_in_flight == 0


async def test_the_client_says_hello_with_its_pid_before_any_request(fake_scheduler, engine_client):
    await wait_until(lambda: fake_scheduler.hellos)
    assert fake_scheduler.hellos == [FrontendHello(os.getpid())] and not fake_scheduler.received


async def test_abort_reaches_the_scheduler_and_ends_the_stream(fake_scheduler, engine_client):
    stream = engine_client.generate("cmpl-held", [0, 1], SamplingParams())
    pending = asyncio.ensure_future(stream.__anext__())
    await wait_until(lambda: fake_scheduler.received)
    engine_client.abort("cmpl-held")
    assert await asyncio.wait_for(pending, 5) == EngineDelta([], "abort")
    await wait_until(lambda: len(fake_scheduler.received) == 2)
    abort = fake_scheduler.received[1]
    assert isinstance(abort, AbortRequest) and abort.request_ids == ["cmpl-held"]
    assert abort.choice_indices.tolist() == []  # every choice


async def test_abort_of_one_choice_reaches_the_scheduler_and_leaves_the_stream_open(
        fake_scheduler, engine_client):
    stream = engine_client.generate("cmpl-two", [0, 1], SamplingParams(n=2))
    pending = asyncio.ensure_future(stream.__anext__())
    await wait_until(lambda: fake_scheduler.received)
    engine_client.abort_choice("cmpl-two", 1)
    await wait_until(lambda: len(fake_scheduler.received) == 2)
    abort = fake_scheduler.received[1]
    assert isinstance(abort, AbortRequest) and abort.request_ids == ["cmpl-two"]
    assert abort.choice_indices.tolist() == [1]
    assert not pending.done() and engine_client.num_in_flight == 1  # its deltas come from the scheduler
    engine_client.abort("cmpl-two")
    assert (await asyncio.wait_for(pending, 5)).finish_reason == "abort"


async def test_requests_fail_when_the_scheduler_goes_silent(fake_scheduler, engine_client):
    fake_scheduler.heartbeats = False
    stream = engine_client.generate("cmpl-lost", [0], SamplingParams())
    deltas = await asyncio.wait_for(collect(stream), 5)
    assert deltas[-1].finish_reason == "error"
    assert "sent nothing" in deltas[-1].error_message
    assert not engine_client.is_alive()


def test_the_scheduler_s_last_outputs_do_not_count_as_a_sign_of_life(runtime_dir):
    import numpy as np

    from proto import codec
    from proto.messages import SchedulerStats, StepOutputs

    def outputs(stopping: bool) -> bytes:
        return codec.encode(StepOutputs(
            -1, [], np.zeros(1, np.int32), np.zeros(0, np.int32), [], [], SchedulerStats(0, 0, 0, 0.0, 0),
            engine_stopping=stopping))

    client = ZmqEngineClient(runtime_dir, alive_timeout_s=5.0, dead_after_s=10.0)
    client.handle_frame(outputs(False))
    assert client.is_alive()
    client.handle_frame(outputs(True))
    assert not client.is_alive()
    client.handle_frame(outputs(False))  # a stopping scheduler never comes back
    assert not client.is_alive()
