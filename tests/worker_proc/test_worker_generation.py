"""A worker serves only the plans of its own worker group: a plan stamped with another generation
(meant for the group that replaced this rank's, or for an older one) is refused, counted and
never answered, so a stale rank can neither compute nor answer a step of the serving group."""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading

import zmq
from garbage_frames import step_plan

from proto import codec, sockets
from proto.config import EngineConfig
from worker_proc.loop import FrameCounters, serve
from worker_proc.null_runner import NullModelRunner

CONFIG = EngineConfig(null_model=True, vocab_size=50, num_kv_blocks=16)


def test_a_worker_of_generation_1_refuses_plans_of_other_generations_and_serves_its_own() -> None:
    config = CONFIG.with_updates(runtime_dir=sockets.make_runtime_dir(), worker_generation=1)
    context = zmq.Context()
    plans = sockets.bind(context, zmq.PUSH, config.runtime_dir, sockets.plan_channel(0))
    results = sockets.bind(context, zmq.PULL, config.runtime_dir, sockets.RESULTS)
    worker_plans = sockets.connect(context, zmq.PULL, config.runtime_dir, sockets.plan_channel(0))
    worker_results = sockets.connect(context, zmq.PUSH, config.runtime_dir, sockets.RESULTS)
    counters, stop = FrameCounters(), threading.Event()
    runner = NullModelRunner(config, rank=0)
    thread = threading.Thread(target=serve, daemon=True, kwargs=dict(
        runner=runner, plans=worker_plans, results=worker_results, stop=stop, parent_pid=os.getppid(),
        counters=counters, generation=config.worker_generation))
    thread.start()
    try:
        plan = step_plan(0, ["a"], [0], [[1]])
        for generation in (0, 2):
            sockets.send(plans, dataclasses.replace(plan, generation=generation))
        assert sockets.recv_ready(results, 0.5) is None
        assert counters.num_refused_plans == 2 and counters.num_steps == 0
        own = dataclasses.replace(plan, generation=1)
        sockets.send(plans, own)
        frame = sockets.recv_ready(results, 5.0)
        assert frame == codec.encode(NullModelRunner(config, rank=0).execute(own))
        assert counters.num_steps == 1 and counters.num_refused_plans == 2
    finally:
        stop.set()
        thread.join(timeout=5)
        context.destroy(linger=0)
        shutil.rmtree(config.runtime_dir, ignore_errors=True)
