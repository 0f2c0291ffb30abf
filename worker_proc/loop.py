"""The worker process loop: the only place with sockets. Start-up handshake, then plan -> result."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

import numpy as np
import zmq

from proto import codec, sockets
from proto.config import EngineConfig
from proto.errors import ProtocolError
from proto.control import ProcessFailed, ProcessReady
from proto.messages import StepPlan, StepResult, WorkerReady
from worker_proc.faults import FaultInjector
from worker_proc.null_runner import NullModelRunner
from worker_proc.runner import ModelRunner, create_runner

log = logging.getLogger(__name__)

POLL_TIMEOUT_S = 0.5  # also how often we notice a dead parent or a SIGTERM
FAREWELL_LINGER_MS = 2000  # let ProcessFailed reach the supervisor before the process exits
_PR_SET_PDEATHSIG = 1


@dataclass
class FrameCounters:
    """What serve() has read: plans executed, frames dropped as protocol errors, and plans
    refused because they were for another worker group."""

    num_steps: int = 0
    num_protocol_errors: int = 0
    num_refused_plans: int = 0


def run_worker(config: EngineConfig, rank: int, parent_pid: int | None = None) -> int:
    """Returns the process exit code: 0 after a clean stop, 1 when start-up failed. parent_pid:
    the supervisor, read as the process started (default: the parent now)."""
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    stop = threading.Event()
    _exit_with_parent(parent_pid, stop)
    name = f"worker{rank}"
    context = zmq.Context()
    control = sockets.connect(context, zmq.PUSH, config.runtime_dir, sockets.CONTROL)
    control.setsockopt(zmq.LINGER, FAREWELL_LINGER_MS)
    try:
        # The step channels are tcp:// to node 0 when the ranks span nodes (CURVE clients with
        # --transport-keys); control stays on this node.
        plans = sockets.connect_channel(context, zmq.PULL, config, sockets.plan_channel(rank),
                                        sockets.max_frame_bytes(config))
        results = sockets.connect_channel(context, zmq.PUSH, config, sockets.RESULTS)
        log.info("%s starting: model %s", name, config.model or "(null model)")
        faults = FaultInjector(rank)
        runner = create_runner(config, rank)
    except Exception as exc:  # any start-up failure must reach the supervisor, not just stderr
        log.exception("%s failed to start", name)
        message = f"{name} failed to start with model {config.model!r}: {type(exc).__name__}: {exc}"
        sockets.send(control, ProcessFailed(name=name, pid=os.getpid(), message=message))
        context.destroy(linger=FAREWELL_LINGER_MS)
        return 1
    sockets.send(results, WorkerReady(rank=rank, num_kv_blocks=runner.num_kv_blocks, pid=os.getpid(),
                                      generation=config.worker_generation, dtype=config.dtype,
                                      kv_cache_dtype=config.kv_dtype))
    detail = f"model={config.model} num_kv_blocks={runner.num_kv_blocks} generation={config.worker_generation}"
    sockets.send(control, ProcessReady(name=name, pid=os.getpid(), detail=detail))
    try:
        serve(runner, plans, results, stop, parent_pid, faults=faults, generation=config.worker_generation)
    finally:
        context.destroy(linger=0)
    log.info("%s stopped", name)
    return 0


def serve(runner: ModelRunner | NullModelRunner, plans: zmq.Socket, results: zmq.Socket,
          stop: threading.Event, parent_pid: int, counters: FrameCounters | None = None,
          faults: FaultInjector | None = None, generation: int = 0) -> None:
    """Execute plans until SIGTERM or the parent dies; bad frames and failed steps never end it.
    Every rank answers every step: rank 0 with the tokens, the others with an acknowledgement.
    A frame that is not a StepPlan is counted in `counters` and gets no answer; so is a plan for
    another worker group than this rank's `generation` (a stale rank never computes, nor answers,
    a step of the group that replaced its own)."""
    counters = counters if counters is not None else FrameCounters()
    faults = faults if faults is not None else FaultInjector(runner.rank, {})
    while not stop.is_set():
        frame = sockets.recv_ready(plans, POLL_TIMEOUT_S)
        if frame is None:
            if os.getppid() != parent_pid:
                log.warning("parent %d is gone: exiting", parent_pid)
                return
            continue
        try:
            plan = codec.decode(frame, StepPlan)
        except ProtocolError as exc:
            counters.num_protocol_errors += 1
            log.error("dropped a bad frame (%d so far): %s", counters.num_protocol_errors, exc)
            continue
        if plan.generation != generation:
            counters.num_refused_plans += 1
            log.error("refused the plan of step %d: it is for worker group %d, this rank belongs to "
                      "group %d (%d refused so far)", plan.step_id, plan.generation, generation,
                      counters.num_refused_plans)
            continue
        result = execute_step(runner, plan, faults)
        counters.num_steps += 1
        sockets.send(results, result)


def execute_step(runner: ModelRunner | NullModelRunner, plan: StepPlan,
                 faults: FaultInjector | None = None) -> StepResult:
    """A failed step (an exception, MemoryError included) becomes an error result instead of a
    hang: the scheduler has the group replaced and its requests recomputed (scheduler_proc.loop)."""
    try:
        if faults is not None:
            faults.fire(plan.step_id)
        return runner.execute(plan)
    except Exception as exc:
        log.exception("step %d failed", plan.step_id)
        return StepResult(step_id=plan.step_id, sampled_token_ids=np.empty(0, dtype=np.int32),
                          error=f"worker step {plan.step_id} failed: {type(exc).__name__}: {exc}",
                          rank=runner.rank)


def _exit_with_parent(parent_pid: int, stop: threading.Event) -> None:
    """SIGTERM (ours, or the kernel's when the parent dies) sets `stop`; the loop sees it on poll."""
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        stop.set()
