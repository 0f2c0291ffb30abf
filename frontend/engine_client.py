"""The frontend's link to the scheduler: AddRequest/AbortRequest out, StepOutputs routed to requests."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import numpy as np
import zmq
import zmq.asyncio

from frontend.engine_outputs import EngineDelta, EngineListener, OutputRouter
from proto import codec, sockets
from proto.errors import ProtocolError
from proto.grammar import GrammarSpec
from proto.messages import AbortRequest, AddRequest, FrontendHello, SchedulerStats, StepOutputs
from proto.processes import process_alive
from proto.sampling import SamplingParams

logger = logging.getLogger(__name__)

ALIVE_TIMEOUT_S = 5.0  # the scheduler heartbeats when idle, so silence this long means trouble
# The scheduler sends something at least once a second (a step, or a heartbeat: idle, in a step,
# while workers are replaced); silence this long is a hung scheduler, reported to the supervisor.
HANG_AFTER_S = 10.0


class EngineUnavailableError(RuntimeError):
    """The scheduler cannot take a request right now (not connected, or its inbox is full)."""


class EngineClient(Protocol):
    """What the HTTP layer needs from the engine; tests substitute an in-process fake.

    `generate` yields deltas (each naming its choice) until every one of the request's
    `sampling_params.n` choices has had its terminal delta. `abort` tells the scheduler to drop
    the request (all its choices) and, if its stream is still open, ends every open choice with a
    finish_reason "abort" delta. `abort_choice` tells the scheduler to drop one choice that the
    caller has already ended (a stop string); the stream stays open, and that choice's terminal
    delta comes from the scheduler. Listeners see every StepOutputs (metrics).
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 grammar: GrammarSpec | None = None) -> AsyncIterator[EngineDelta]: ...

    def abort(self, request_id: str) -> None: ...

    def abort_choice(self, request_id: str, choice_index: int) -> None: ...

    def is_alive(self) -> bool: ...

    def add_listener(self, listener: EngineListener) -> None: ...

    @property
    def latest_stats(self) -> SchedulerStats | None: ...


class ZmqEngineClient:
    """EngineClient over ZMQ: PUSH to the scheduler's REQUESTS, PULL from its OUTPUTS (it binds both).

    One background task receives every StepOutputs and hands it to the OutputRouter.
    A request that the scheduler stops talking about gets an "error" delta after `dead_after_s`.

    A replaced scheduler: every StepOutputs names the scheduler process that sent it and the epoch
    of the last FrontendHello it read. The first message from another scheduler than the one that
    answered our hello starts a recovery: say hello again with the next epoch, then resubmit every
    open request with what it has received so far (AddRequest.resume). Until outputs stamped with
    the new epoch arrive, we are `recovering`, and outputs stamped with another epoch are dropped
    (they come from before the resubmissions, or from the lost scheduler), so no token is counted
    twice. A scheduler silent for `hang_after_s` is reported through `on_scheduler_hung(pid,
    reason)` (the supervisor kills and replaces it).
    """

    def __init__(self, runtime_dir: str, alive_timeout_s: float = ALIVE_TIMEOUT_S,
                 dead_after_s: float = 120.0 + ALIVE_TIMEOUT_S, max_frame_bytes: int = -1,
                 hang_after_s: float = HANG_AFTER_S,
                 on_scheduler_hung: Callable[[int, str], None] | None = None,
                 scheduler_alive: Callable[[int], bool] = process_alive) -> None:
        """`dead_after_s` must exceed the longest legitimate silence (a scheduler's replacement);
        `max_frame_bytes` (proto.sockets.max_frame_bytes) caps an OUTPUTS frame, -1 = no cap;
        `scheduler_alive(pid)` looks at the scheduler's process (it runs on this node)."""
        self._runtime_dir = runtime_dir
        self._max_frame_bytes = max_frame_bytes
        self._alive_timeout_s = alive_timeout_s
        self._dead_after_s = dead_after_s
        self._router = OutputRouter()
        self._last_received_s: float | None = None  # this process's monotonic clock
        self._engine_stopping = False  # the scheduler said its last word: never alive again
        self._started_s = time.monotonic()
        self._context: zmq.Context | None = None
        self._requests: zmq.Socket | None = None  # sync: sends never wait (NOBLOCK)
        self._outputs: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self.num_protocol_errors = 0
        self._hang_after_s = hang_after_s
        self._on_scheduler_hung = on_scheduler_hung
        self._epoch = 0  # of our last FrontendHello
        self._scheduler_pid = 0  # the scheduler our requests go to (0: none heard yet)
        self._hung_pid = 0  # the scheduler last reported as hung (once per process)
        self._replaced_pids: set[int] = set()  # schedulers we moved away from: their frames are stale
        self.recovering = False  # a new scheduler is taking over: requests are held, not failed
        self.num_scheduler_replacements = 0
        self._scheduler_alive = scheduler_alive

    async def start(self) -> None:
        self._context = zmq.Context()
        self._requests = sockets.connect(self._context, zmq.PUSH, self._runtime_dir, sockets.REQUESTS)
        outputs = sockets.connect(self._context, zmq.PULL, self._runtime_dir, sockets.OUTPUTS,
                                  self._max_frame_bytes)
        self._outputs = zmq.asyncio.Socket.from_socket(outputs)
        # First on the connection, before any request: the scheduler aborts what an earlier
        # frontend left unfinished and from now on watches this process.
        self._send(FrontendHello(os.getpid()))
        self._started_s = time.monotonic()
        self._receiver = asyncio.create_task(self._receive_loop(), name="engine-outputs")

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        if self._outputs is not None:
            self._outputs.close(linger=0)  # drops its reader from the event loop
        if self._context is not None:
            self._context.destroy(linger=0)  # closes the underlying sockets too
        self._receiver = self._requests = self._outputs = self._context = None

    @property
    def latest_stats(self) -> SchedulerStats | None:
        return self._router.latest_stats

    @property
    def num_in_flight(self) -> int:
        return len(self._router)

    def add_listener(self, listener: EngineListener) -> None:
        self._router.add_listener(listener)

    def is_alive(self) -> bool:
        """A message was RECEIVED within `alive_timeout_s` (our clock, never the scheduler's), the
        scheduler has not said it is stopping, and its process has not exited: a killed scheduler
        says nothing, and /health must not wait out its silence to turn 503."""
        heard = self._last_received_s is not None and not self._engine_stopping and not self.recovering
        if not heard or self.seconds_since_last_message() >= self._alive_timeout_s:
            return False
        return not self._scheduler_pid or self._scheduler_alive(self._scheduler_pid)

    def seconds_since_last_message(self) -> float:
        since = self._started_s if self._last_received_s is None else self._last_received_s
        return time.monotonic() - since

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       grammar: GrammarSpec | None = None) -> AsyncIterator[EngineDelta]:
        if sampling_params.seed is None and sampling_params.temperature > 0:  # drawn here, so that a
            # resubmission to a replaced scheduler continues the same noise (greedy needs none)
            sampling_params = dataclasses.replace(sampling_params, seed=random.getrandbits(63))
        prompt = np.asarray(prompt_token_ids, dtype=np.int32)  # int32 [num_prompt_tokens]
        add = AddRequest(request_id, prompt, sampling_params, time.time(), grammar)
        route = self._router.open(request_id, sampling_params.n, add)
        try:
            self._send(add)
        except BaseException:
            self._router.discard(request_id)
            raise
        async for delta in route.deltas():
            yield delta

    def abort(self, request_id: str) -> None:
        if not self._router.abort(request_id):  # already finished: the scheduler holds nothing
            return
        try:
            self._send(AbortRequest([request_id]))
        except EngineUnavailableError as exc:
            logger.warning("could not send abort for %s: %s", request_id, exc)

    def abort_choice(self, request_id: str, choice_index: int) -> None:
        if not self._router.is_open(request_id):  # already finished: the scheduler holds nothing
            return
        self._router.end_choice_here(request_id, choice_index)
        try:
            self._send(AbortRequest([request_id], np.asarray([choice_index], dtype=np.int32)))
        except EngineUnavailableError as exc:  # it then runs on until it ends or the request does
            logger.warning("could not send abort for %s choice %d: %s", request_id, choice_index, exc)

    def handle_frame(self, frame: bytes) -> None:
        """Decode and route one OUTPUTS frame; a bad frame is logged and counted, never fatal."""
        try:
            message = codec.decode(frame, StepOutputs)
        except ProtocolError as exc:
            self.num_protocol_errors += 1
            logger.error("dropping a malformed scheduler frame (%d so far): %s",
                         self.num_protocol_errors, exc)
            self._router.protocol_error()
            return
        stats = message.stats
        if stats.scheduler_pid in self._replaced_pids:
            return  # a lost scheduler's last frames, behind the new one's
        self._last_received_s = time.monotonic()
        if not self._scheduler_pid:
            self._scheduler_pid = stats.scheduler_pid
        elif stats.scheduler_pid and stats.scheduler_pid != self._scheduler_pid:
            self._resubmit_to(stats.scheduler_pid)
        # A scheduler's last word (its shutdown or crash); a replacement speaks for itself.
        self._engine_stopping = self._engine_stopping or message.engine_stopping
        if stats.frontend_epoch != self._epoch:
            return  # sent before the scheduler read our latest hello
        self.recovering = False
        self._router.route(message, self._last_received_s)

    def _resubmit_to(self, scheduler_pid: int) -> None:
        """A new scheduler replaced ours: hello (it then drops whatever reached it before), then
        every open request again, continuing from what it has received."""
        logger.warning("a new scheduler (pid %d) replaced pid %d: resubmitting %d requests",
                       scheduler_pid, self._scheduler_pid, len(self._router))
        self._replaced_pids.add(self._scheduler_pid)
        self._scheduler_pid, self._epoch = scheduler_pid, self._epoch + 1
        self.recovering, self._engine_stopping = True, False
        self.num_scheduler_replacements += 1
        num_sequences_resubmitted = 0
        try:
            self._send(FrontendHello(os.getpid(), self._epoch))
            adds = self._router.resubmissions()
            for add in adds:
                self._send(add)
            num_sequences_resubmitted = sum(int(np.count_nonzero(~add.resume.finished)) for add in adds)
        except EngineUnavailableError as exc:
            num_failed = self._router.fail_all(f"could not resubmit to the new scheduler: {exc}")
            logger.error("could not resubmit to the new scheduler (%d requests failed): %s", num_failed, exc)
        self._router.scheduler_replaced(num_sequences_resubmitted)

    def report_hung_scheduler(self) -> None:
        """Tell the supervisor (once per scheduler process) that ours has been silent too long."""
        silent_s = self.seconds_since_last_message()
        pid = self._scheduler_pid
        if not pid or pid == self._hung_pid or silent_s < self._hang_after_s or self._engine_stopping:
            return
        self._hung_pid = pid
        self.recovering = True
        reason = f"the frontend heard nothing from it for {silent_s:.0f} s (no step, no heartbeat)"
        logger.error("scheduler pid %d hangs: %s; asking the supervisor to replace it", pid, reason)
        if self._on_scheduler_hung is not None:
            self._on_scheduler_hung(pid, reason)

    def fail_silent_requests(self) -> None:
        """End every open request with an error once the scheduler has been silent too long."""
        silent_s = self.seconds_since_last_message()
        if not len(self._router) or silent_s < self._dead_after_s:
            return
        message = f"the scheduler has sent nothing for {silent_s:.0f} s; the request was failed"
        num_failed = self._router.fail_all(message)
        logger.error("%s (%d requests)", message, num_failed)

    async def _receive_loop(self) -> None:
        poll_ms = int(min(self._alive_timeout_s, 1.0) * 1000)
        while True:
            if not await self._outputs.poll(poll_ms, zmq.POLLIN):
                self.report_hung_scheduler()
                self.fail_silent_requests()
                continue
            frame = await self._outputs.recv(copy=True)
            try:
                self.handle_frame(frame)
            except Exception:  # a routing bug must not stop every other request's outputs
                logger.exception("error while routing scheduler outputs")

    def _send(self, message: AddRequest | AbortRequest | FrontendHello) -> None:
        if self._requests is None:
            raise EngineUnavailableError("the engine client is not started")
        try:
            # NOBLOCK: a full or absent scheduler must never stall the event loop.
            self._requests.send(codec.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise EngineUnavailableError("the scheduler is not accepting requests (inbox full)") from exc
