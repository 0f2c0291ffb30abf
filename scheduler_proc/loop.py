"""The scheduler process's step loop: its sockets to the frontend and the supervisor, and each step
through the worker group (worker_group.py holds the step channels)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import numpy as np
import zmq

from proto import codec, sockets
from proto.config import EngineConfig
from proto.errors import ValidationError
from proto.faults import Fault
from proto.control import ProcessFailed, ProcessReady, RestartWorkers
from proto.messages import AbortRequest, AddRequest, FrontendHello, StepOutputs, StepPlan, StepResult
from proto.processes import process_alive
from scheduler_proc.admission import startup_capacity_error
from scheduler_proc.engine import SchedulerEngine
from scheduler_proc.faults import scheduler_fault
from scheduler_proc.frontend_watch import FrontendWatch
from scheduler_proc.process_memory import ProcessMemory
from scheduler_proc.worker_group import POLL_SLICE_S, FrameReader, WorkerGroup, ranks_text, send_frame

logger = logging.getLogger(__name__)

# The frontend's liveness signal while nothing else is sent: idle, during a step (while it waits
# for the workers) and while a worker group is replaced. A longer silence means a hung scheduler.
HEARTBEAT_INTERVAL_S = 1.0
MAX_FRAMES_PER_DRAIN = 4096  # bounds one inbox drain so a flood cannot starve running steps
FINAL_MESSAGE_LINGER_MS = 1000  # time for last outputs / ProcessFailed to leave at exit


class SchedulerLoop:
    """Binds the scheduler's sockets, waits for every worker rank, then runs steps until told
    to stop (request_stop, e.g. from SIGTERM) or until the parent process is gone."""

    def __init__(self, config: EngineConfig, context: zmq.Context | None = None,
                 parent_pid: int | None = None) -> None:
        self.config = config
        self.engine: SchedulerEngine | None = None
        self._reader = FrameReader()
        self._context = context or zmq.Context()
        self._owns_context = context is None
        self._stopping = False
        self._parent_pid = os.getppid() if parent_pid is None else parent_pid
        self._last_sent_s = 0.0  # time.monotonic() of the last message to the frontend
        self._sockets: list[zmq.Socket] = []
        self._control: zmq.Socket | None = None  # set with the others by _open_sockets
        self._outputs: zmq.Socket | None = None
        self._workers = WorkerGroup(config, self._context, self._reader, self._should_exit)
        self._memory = ProcessMemory(self._workers.local_pids)
        self._fatal_error = ""  # set when the loop cannot go on: it ends, the stack stops
        self._lost_before_stop = ""  # a step lost to a dead rank as the stack stopped
        self._workers_serving = False  # False until the group is ready, and while it is replaced
        self.num_worker_restarts = 0  # worker groups lost and replaced
        self._frontend = FrontendWatch(process_alive)
        self._frontend_epoch = -1  # FrontendHello.epoch of the last hello
        self._fault: Fault | None = None  # test-only (CONVEYOR_SCHEDULER_FAULT)

    @property
    def num_protocol_errors(self) -> int:
        """Frames dropped as malformed, unexpected or stale, on every socket."""
        return self._reader.num_protocol_errors

    def request_stop(self) -> None:
        """Ask the loop to finish; safe to call from a signal handler or another thread."""
        self._stopping = True

    def run(self) -> int:
        """Serve until stopped; the process exit code (non-zero when start-up failed)."""
        try:
            self._open_sockets()
        except (zmq.ZMQError, ValidationError) as exc:
            self._fail(f"cannot open the scheduler's sockets in {self.config.runtime_dir!r}: {exc}")
            self._close()
            return 1
        try:
            self._fault = scheduler_fault()
        except ValueError as exc:
            self._fail(str(exc))
            self._close()
            return 1
        try:
            num_kv_blocks = self._await_workers()
            if num_kv_blocks is None:
                return 0 if self._should_exit() else 1
            capacity_error = startup_capacity_error(self.config, num_kv_blocks)
            if capacity_error:
                self._fail(capacity_error)
                return 1
            self.engine = SchedulerEngine(self.config, num_kv_blocks)
            self.engine.scheduler_pid = os.getpid()
            self.engine.frontend_epoch = self._frontend_epoch
            self._workers_serving = True
            sockets.send(self._control, ProcessReady("scheduler", os.getpid(), f"{num_kv_blocks} KV blocks"))
            logger.info("scheduler ready: %d KV blocks of %d tokens, %s scheduling", num_kv_blocks,
                        self.config.block_size, self.config.scheduling)
            self._serve()
            if self._fatal_error:
                self._fail(self._fatal_error)
                return 3
            return 0
        except Exception as exc:
            logger.exception("scheduler loop crashed")
            self._fail_unfinished(f"the scheduler crashed: {exc!r}")
            self._fail(f"scheduler loop crashed: {exc!r}")
            return 2
        finally:
            self._close()

    def _open_sockets(self) -> None:
        ctx, run_dir, config = self._context, self.config.runtime_dir, self.config
        max_frame_bytes = sockets.max_frame_bytes(config)
        self._control = self._track(sockets.connect(ctx, zmq.PUSH, run_dir, sockets.CONTROL))
        self._requests = self._track(sockets.bind(ctx, zmq.PULL, run_dir, sockets.REQUESTS, max_frame_bytes))
        self._outputs = self._track(sockets.bind(ctx, zmq.PUSH, run_dir, sockets.OUTPUTS))
        self._workers.open()

    def _track(self, sock: zmq.Socket) -> zmq.Socket:
        self._sockets.append(sock)
        return sock

    def _close(self) -> None:
        self._workers.close()
        for sock in self._sockets:
            # Final outputs and ProcessFailed may still be queued: let them leave.
            keep = sock is self._control or sock is self._outputs
            sock.close(linger=FINAL_MESSAGE_LINGER_MS if keep else 0)
        self._sockets.clear()
        if self._owns_context:
            self._context.destroy(linger=0)  # also closes a socket whose bind failed half-way

    def _fail_unfinished(self, message: str) -> None:
        """Best effort after a crash: give the frontend every request's terminal output."""
        try:
            if self.engine is not None:
                self._send_outputs(self.engine.finish_all(message), wait=False)
        except Exception:  # the engine may be what broke; the supervisor still sees us exit
            logger.exception("could not fail the unfinished requests")

    def _stopping_message(self) -> str:
        """What the requests still unfinished when the loop ends are told."""
        if self._lost_before_stop:
            return f"the server is stopping after a lost worker: {self._lost_before_stop}"
        return "the scheduler is shutting down"

    def _should_exit(self) -> bool:
        return self._stopping or bool(self._fatal_error) or os.getppid() != self._parent_pid

    def _fail(self, message: str) -> None:
        """Log and tell the supervisor (when the control socket got as far as opening)."""
        logger.error("%s", message)
        if self._control is None:
            return
        try:
            sockets.send(self._control, ProcessFailed("scheduler", os.getpid(), message))
        except zmq.ZMQError:
            logger.exception("could not report the failure to the supervisor")

    def _await_workers(self) -> int | None:
        """min over ranks of the reported KV blocks, or None (ProcessFailed sent) on timeout.
        While a lost group is replaced (the engine exists), new requests are queued and the
        frontend hears heartbeats that say no group is serving."""
        num_kv_blocks, failure = self._workers.gather(
            lambda: self._serve_frontend_only() if self.engine is not None else None)
        if failure:
            self._fail(failure)
        return num_kv_blocks

    def _serve(self) -> None:
        engine = self.engine
        while not self._should_exit():
            self._drain_requests()
            self._frontend.abort_if_exited(self.engine)
            pending = engine.drain_outputs()
            if pending is not None:
                self._send_outputs(pending)
            plan = engine.schedule()
            if plan is None:
                self._idle_wait()
                continue
            # Every step is reported, tokens or not: its stats and lifecycle events feed metrics.
            self._send_outputs(self._run_step(plan))
        final = engine.finish_all(self._fatal_error or self._stopping_message())
        if final.num_outputs:
            self._send_outputs(final, wait=False)

    def _drain_requests(self) -> None:
        for _ in range(MAX_FRAMES_PER_DRAIN):
            try:
                frame = self._requests.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            match self._reader.decode(frame, sockets.REQUEST_MESSAGES):
                case AddRequest() as add:
                    self.engine.add(add, seats_open=self._workers_serving)
                case AbortRequest() as abort:
                    self.engine.abort(abort.request_ids, abort.choice_indices.tolist())
                case FrontendHello() as hello:
                    self._frontend.greet_and_abort_earlier(hello.pid, self.engine)
                    self._frontend_epoch = self.engine.frontend_epoch = hello.epoch

    def _serve_frontend_only(self) -> None:
        self._drain_requests()
        self._frontend.abort_if_exited(self.engine)
        pending = self.engine.drain_outputs()
        if pending is not None:
            self._send_outputs(pending, wait=False)
        elif self._heartbeat_due():
            self._send_outputs(self.engine.heartbeat(), wait=False)

    def _idle_wait(self) -> None:
        """Block on the requests socket and the local ranks' exits (no busy waiting); heartbeat
        about once a second. A rank that died meanwhile lost the group as in a step: the supervisor
        is replacing it, and serving waits for the new one."""
        if self._heartbeat_due():
            self._send_outputs(self.engine.heartbeat(), wait=False)
        poller = zmq.Poller()
        poller.register(self._requests, zmq.POLLIN)
        exits = self._workers.watch_exits(poller)
        dead = self._workers.lost_ranks(dict(poller.poll(int(POLL_SLICE_S * 1000))), exits)
        if dead:
            self._send_outputs(self._lost_step("between steps", dead))

    def _heartbeat_due(self) -> bool:
        return time.monotonic() - self._last_sent_s >= HEARTBEAT_INTERVAL_S

    def _run_step(self, plan: StepPlan) -> StepOutputs:
        if self._fault is not None:
            self._fault.fire(plan.step_id)
        # Encoded once, the same bytes to every rank; a rank of another group refuses it.
        frame = codec.encode(dataclasses.replace(plan, generation=self._workers.generation))
        started_s = time.monotonic()
        deadline = started_s + self.config.step_timeout_s
        refused = self._workers.send_plan(frame, deadline)
        if refused is not None:
            return self._lost_step(f"worker rank {refused} did not take the plan of step {plan.step_id}",
                                   [refused])
        result, silent = self._workers.await_result(plan.step_id, started_s, deadline, self._step_heartbeat)
        if result is None:
            return self._lost_step(f"worker {ranks_text(silent)} did not answer step {plan.step_id}", silent)
        if result.error:
            return self._failed_step(result)
        return self.engine.apply_result(result)

    def _failed_step(self, result: StepResult) -> StepOutputs:
        """A rank raised in the step (its state is not trusted after that): the group is replaced
        as after a lost step, and the step's members are recomputed one at a time, where an input
        that raises again ends alone (SchedulerEngine.recover_failed_step)."""
        cause = f"worker rank {result.rank} failed step {result.step_id}: {result.error}"
        if self._should_exit():
            return self.engine.apply_result(result)  # the stack stops: the step's requests fail
        return self._replace_group(cause, lambda: self.engine.recover_failed_step(cause), [result.rank])

    def _lost_step(self, what: str, silent: list[int]) -> StepOutputs:
        """Ranks that died, or did not take or answer a step in time, lost the group's KV cache:
        running requests go back to waiting (tokens kept), the supervisor replaces the group
        (told here which ranks hang; it sees deaths itself), and serving resumes once every
        rank of the new group is ready. The supervisor bounds how often (--max-restarts)."""
        dead = self._workers.dead_ranks(silent)
        hung = [rank for rank in silent if rank not in dead]
        cause = f"{what}: {ranks_text(dead)} died" if dead else \
            f"{what}: no answer within {self.config.step_timeout_s} s (--step-timeout)"
        if self._should_exit():  # the stack stops (asked to, or past --max-restarts after this loss)
            self._lost_before_stop = cause if dead else ""  # silence is then the stop's, not a fault
            return self.engine.fail_running(self._stopping_message())
        return self._replace_group(cause, self.engine.recover_lost_step, [] if dead else hung)

    def _replace_group(self, cause: str, recover: Callable[[], StepOutputs],
                       restart_ranks: list[int]) -> StepOutputs:
        """Requeue the running requests (`recover`) and serve again once every rank of a new group
        is ready; the supervisor replaces the group (it sees deaths itself; restart_ranks are
        alive and must be killed first)."""
        num_recovered = self.engine.num_requests_recovered_total
        recovered = recover()
        logger.error("%s; requeued %d running requests, waiting for a new worker group", cause,
                     self.engine.num_requests_recovered_total - num_recovered)
        self._workers_serving = False
        self.num_worker_restarts += 1
        self._send_outputs(recovered, wait=False)
        if restart_ranks:
            sockets.send(self._control, RestartWorkers(np.asarray(restart_ranks, dtype=np.int32), cause))
        self._workers.reopen()
        num_kv_blocks = self._await_workers()
        if num_kv_blocks is not None and num_kv_blocks < self.engine.block_manager.num_blocks:
            self._fail(f"the new worker group has {num_kv_blocks} KV blocks, the lost one had "
                       f"{self.engine.block_manager.num_blocks}")
            num_kv_blocks = None
        if num_kv_blocks is None:  # the loop ends: every request, requeued ones included, fails
            self._fatal_error = self._fatal_error or f"no worker group after: {cause}"
            return self.engine.finish_all(self._fatal_error)
        self._workers_serving = True
        logger.info("a new worker group serves (restart %d)", self.num_worker_restarts)
        return self.engine.heartbeat()

    def _step_heartbeat(self, step_running_s: float, step_idle_s: float) -> None:
        # A long step is not a hung scheduler; the frontend tells hung workers by the step's idle time.
        if self._heartbeat_due():
            self._send_outputs(self.engine.progress_heartbeat(step_running_s, step_idle_s), wait=False)

    def _send_outputs(self, outputs: StepOutputs, wait: bool = True) -> None:
        """Deliver to the frontend; without `wait` (heartbeats) nothing waits for a slow reader."""
        deadline = time.monotonic() + (self.config.step_timeout_s if wait else 0.0)
        scheduler_rss_bytes, workers_rss_bytes = self._memory.sample()
        stats = dataclasses.replace(outputs.stats, num_protocol_errors_total=self.num_protocol_errors,
                                    workers_serving=self._workers_serving,
                                    num_worker_restarts_total=self.num_worker_restarts,
                                    scheduler_rss_bytes=scheduler_rss_bytes, workers_rss_bytes=workers_rss_bytes)
        outputs = dataclasses.replace(outputs, stats=stats)
        if self._should_exit():
            outputs = dataclasses.replace(outputs, engine_stopping=True)
        # A dead frontend's outputs are not waited for: its requests are aborted next iteration.
        if send_frame(self._outputs, codec.encode(outputs), deadline,
                      lambda: self._should_exit() or self._frontend.exited()):
            self._last_sent_s = time.monotonic()
        elif outputs.num_outputs and not self._frontend.exited():
            logger.error("the frontend did not take outputs for %s; they are lost", outputs.request_ids)
