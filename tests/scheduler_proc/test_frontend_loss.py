"""A lost frontend's requests have no client any more: the scheduler aborts them all and frees
their seats and KV blocks, at once when the frontend's process exits, and at the latest when a new
frontend says hello."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from loop_harness import Frontend, running_loop
from proto import sockets
from proto.messages import FrontendHello, StepPlan, StepResult
from scheduler_fakes import FakeWorker, Harness
from scheduler_proc.loop import SchedulerLoop


def test_abort_all_ends_every_request_and_frees_every_block_shared_ones_included() -> None:
    harness = Harness(num_blocks=24, max_num_seqs=3)
    shared_prompt = list(range(100, 116))  # four full blocks, shared through the prefix cache
    harness.add("first", shared_prompt, max_tokens=40)
    harness.step()
    harness.add("sibling-of-cache", shared_prompt + [7], max_tokens=40)
    harness.add("several", 6, max_tokens=40, n=3)
    harness.add("queued", 30, max_tokens=40)
    for _ in range(3):
        harness.step()
    assert harness.engine.block_manager.usage > 0 and harness.engine.queues.waiting

    assert harness.engine.abort_all() == 4
    harness.engine.check_invariants()
    harness.log.record(harness.engine.drain_outputs())
    assert set(harness.log.finish_reasons.values()) == {"abort"} and len(harness.log.finish_reasons) == 6
    assert harness.engine.block_manager.usage == 0 and not harness.engine.has_unfinished_requests
    stats = harness.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    harness.add("after", 5, max_tokens=3)  # the engine serves on
    harness.run()
    assert harness.log.finish_reasons["after"] == "length"


class SlowWorker:
    """The harness's fake worker, 20 ms a step: requests stay in flight long enough to lose them."""

    def __init__(self, fake: FakeWorker) -> None:
        self._fake = fake

    def __getattr__(self, name: str) -> object:
        return getattr(self._fake, name)

    def __call__(self, plan: StepPlan) -> StepResult:
        time.sleep(0.02)
        return self._fake(plan)


@contextmanager
def stand_in_frontend_process() -> Iterator[subprocess.Popen]:
    """A process whose pid a hello names, to be killed as the frontend would be."""
    process = subprocess.Popen(["sleep", "60"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def start_two_long_requests(frontend: Frontend) -> None:
    frontend.worker.fake = SlowWorker(frontend.worker.fake)
    frontend.add("a", 6, max_tokens=200)
    frontend.add("b", 6, max_tokens=200)
    deadline = time.monotonic() + 5
    while len(frontend.log.tokens.get("a", [])) < 2:
        frontend.receive(max(deadline - time.monotonic(), 0.01))


def wait_until_empty(loop: SchedulerLoop, timeout_s: float) -> float:
    """Seconds until the engine holds no request and no KV block (a read from the test thread)."""
    started = time.monotonic()
    while loop.engine.has_unfinished_requests or loop.engine.block_manager.usage > 0:
        assert time.monotonic() - started < timeout_s, "the lost frontend's requests still run"
        time.sleep(0.01)
    return time.monotonic() - started


def test_requests_are_aborted_and_their_blocks_freed_within_a_second_of_the_frontends_exit() -> None:
    with running_loop() as (loop, frontend, _control), stand_in_frontend_process() as process:
        sockets.send(frontend.requests, FrontendHello(process.pid))
        start_two_long_requests(frontend)
        assert loop.engine.block_manager.usage > 0
        process.kill()  # no new frontend says hello: the scheduler sees the process gone
        assert wait_until_empty(loop, timeout_s=1.5) < 1.5
        assert "a" not in frontend.log.finish_reasons and "b" not in frontend.log.finish_reasons
        sockets.send(frontend.requests, FrontendHello(os.getpid()))  # the supervisor's new one
        frontend.add("c", 4, max_tokens=3)
        frontend.wait_finished("c")
        assert frontend.log.finish_reasons["c"] == "length" and len(frontend.log.tokens["c"]) == 3


def test_a_new_frontends_hello_aborts_what_an_earlier_one_left_and_then_serves_it() -> None:
    with running_loop() as (loop, frontend, _control), stand_in_frontend_process() as process:
        sockets.send(frontend.requests, FrontendHello(os.getpid()))
        start_two_long_requests(frontend)
        sockets.send(frontend.requests, FrontendHello(process.pid))  # a second frontend, alive
        frontend.add("c", 4, max_tokens=3)
        frontend.wait_finished("c")
        assert frontend.log.finish_reasons["c"] == "length"
        wait_until_empty(loop, timeout_s=1.0)
        assert "a" not in frontend.log.finish_reasons and "b" not in frontend.log.finish_reasons

