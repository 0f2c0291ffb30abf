"""The worker loop takes frames from anywhere on its real plan socket: a frame that is no StepPlan
is counted and gets no answer, and the next plan is answered as if nothing had come before it."""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import zmq
from garbage_frames import rejected_frames, step_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import codec, sockets
from proto.config import EngineConfig
from worker_proc.loop import FrameCounters, serve
from worker_proc.null_runner import NullModelRunner

CONFIG = EngineConfig(null_model=True, vocab_size=50, num_kv_blocks=16)


@contextmanager
def serving_worker() -> Iterator[tuple[zmq.Socket, zmq.Socket, FrameCounters]]:
    """serve() in a thread on the worker's real sockets; yields the scheduler's ends and its counters."""
    config = CONFIG.with_updates(runtime_dir=sockets.make_runtime_dir())
    context = zmq.Context()
    plans = sockets.bind(context, zmq.PUSH, config.runtime_dir, sockets.plan_channel(0))
    results = sockets.bind(context, zmq.PULL, config.runtime_dir, sockets.RESULTS)
    worker_plans = sockets.connect_channel(context, zmq.PULL, config, sockets.plan_channel(0),
                                           sockets.max_frame_bytes(config))
    worker_results = sockets.connect_channel(context, zmq.PUSH, config, sockets.RESULTS)
    counters, stop = FrameCounters(), threading.Event()
    thread = threading.Thread(target=serve, daemon=True, args=(
        NullModelRunner(config, rank=0), worker_plans, worker_results, stop, os.getppid(), counters))
    thread.start()
    try:
        yield plans, results, counters
    finally:
        stop.set()
        thread.join(timeout=5)
        assert not thread.is_alive(), "the worker loop did not stop"
        context.destroy(linger=0)
        shutil.rmtree(config.runtime_dir, ignore_errors=True)


def test_frames_that_are_no_plan_are_counted_unanswered_and_the_next_plan_is_served() -> None:
    reference = NullModelRunner(CONFIG, rank=0)
    with serving_worker() as (plans, results, counters):
        step_ids = itertools.count()

        @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(noise=st.lists(rejected_frames(sockets.PLAN_MESSAGES), max_size=5))
        def check(noise: list[bytes]) -> None:
            before = dataclasses.replace(counters)
            for frame in noise:
                plans.send(frame)
            plan = step_plan(next(step_ids), ["a", "b"], [0, 20], [[1], [2, 3]])
            sockets.send(plans, plan)
            frame = sockets.recv_ready(results, 10.0)
            assert frame is not None, "the worker did not answer the plan after the noise"
            assert frame == codec.encode(reference.execute(plan))  # the first answer is the plan's
            assert counters.num_protocol_errors == before.num_protocol_errors + len(noise)
            assert counters.num_steps == before.num_steps + 1

        check()
        assert sockets.recv_ready(results, 0.2) is None  # and no other answer followed
