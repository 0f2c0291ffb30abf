"""The frontend's link to the scheduler: AddRequest/AbortRequest out, StepOutputs routed to requests."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import zmq
import zmq.asyncio

from proto import codec, sockets
from proto.errors import ProtocolError
from proto.messages import AbortRequest, AddRequest, StepOutputs
from proto.sampling import SamplingParams

logger = logging.getLogger(__name__)

ALIVE_TIMEOUT_S = 5.0  # the scheduler heartbeats when idle, so silence this long means trouble


class EngineUnavailableError(RuntimeError):
    """The scheduler cannot take a request right now (not connected, or its inbox is full)."""


@dataclass(frozen=True)
class EngineDelta:
    """One step's news for one request. `finish_reason` is "" until the single terminal delta."""

    token_ids: list[int]
    finish_reason: str = ""
    error_message: str = ""


@dataclass(frozen=True)
class EngineStats:
    """Scheduler state as of its last message (a step or an idle heartbeat)."""

    step_id: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    step_duration_s: float
    wall_time_s: float


class EngineClient(Protocol):
    """What the HTTP layer needs from the engine; tests substitute an in-process fake.

    `generate` yields deltas until one has a finish reason. `abort` tells the scheduler to drop
    the request and, if its stream is still open, ends it with a finish_reason "abort" delta.
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams) -> AsyncIterator[EngineDelta]: ...

    def abort(self, request_id: str) -> None: ...

    def is_alive(self) -> bool: ...

    @property
    def latest_stats(self) -> EngineStats | None: ...


class ZmqEngineClient:
    """EngineClient over ZMQ: PUSH to the scheduler's REQUESTS, PULL from its OUTPUTS (it binds both).

    Owns the per-request queues; one background task receives and routes every StepOutputs.
    A request that the scheduler stops talking about gets an "error" delta after `dead_after_s`.
    """

    def __init__(self, runtime_dir: str, alive_timeout_s: float = ALIVE_TIMEOUT_S,
                 dead_after_s: float = 120.0 + ALIVE_TIMEOUT_S) -> None:
        """`dead_after_s` must exceed the longest legitimate step (EngineConfig.step_timeout_s)."""
        self._runtime_dir = runtime_dir
        self._alive_timeout_s = alive_timeout_s
        self._dead_after_s = dead_after_s
        self._queues: dict[str, asyncio.Queue[EngineDelta]] = {}
        self._last_received_s: float | None = None  # this process's monotonic clock
        self._started_s = time.monotonic()
        self._latest_stats: EngineStats | None = None
        self._context: zmq.Context | None = None
        self._requests: zmq.Socket | None = None  # sync: sends never wait (NOBLOCK)
        self._outputs: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task | None = None
        self.num_protocol_errors = 0

    async def start(self) -> None:
        self._context = zmq.Context()
        self._requests = sockets.connect(self._context, zmq.PUSH, self._runtime_dir, sockets.REQUESTS)
        outputs = sockets.connect(self._context, zmq.PULL, self._runtime_dir, sockets.OUTPUTS)
        self._outputs = zmq.asyncio.Socket.from_socket(outputs)
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
    def latest_stats(self) -> EngineStats | None:
        return self._latest_stats

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def is_alive(self) -> bool:
        """A message was RECEIVED within `alive_timeout_s` (our clock, never the scheduler's)."""
        heard = self._last_received_s is not None
        return heard and self.seconds_since_last_message() < self._alive_timeout_s

    def seconds_since_last_message(self) -> float:
        since = self._started_s if self._last_received_s is None else self._last_received_s
        return time.monotonic() - since

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling_params: SamplingParams) -> AsyncIterator[EngineDelta]:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[EngineDelta] = asyncio.Queue()
        self._queues[request_id] = queue
        prompt = np.asarray(prompt_token_ids, dtype=np.int32)  # int32 [num_prompt_tokens]
        try:
            self._send(AddRequest(request_id, prompt, sampling_params, time.time()))
        except BaseException:
            del self._queues[request_id]
            raise
        while True:
            delta = await queue.get()
            yield delta
            if delta.finish_reason:
                return

    def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is None:  # already finished: the scheduler holds nothing for it
            return
        try:
            self._send(AbortRequest([request_id]))
        except EngineUnavailableError as exc:
            logger.warning("could not send abort for %s: %s", request_id, exc)
        queue.put_nowait(EngineDelta([], "abort"))

    def handle_frame(self, frame: bytes) -> None:
        """Decode and route one OUTPUTS frame; a bad frame is logged and counted, never fatal."""
        try:
            message = codec.decode(frame)
            if not isinstance(message, StepOutputs):
                raise ProtocolError(f"expected StepOutputs on OUTPUTS, got {type(message).__name__}")
        except ProtocolError as exc:
            self.num_protocol_errors += 1
            logger.error("dropping a malformed scheduler frame (%d so far): %s",
                         self.num_protocol_errors, exc)
            return
        self._last_received_s = time.monotonic()
        self._latest_stats = EngineStats(
            message.step_id, message.num_running, message.num_waiting, message.kv_cache_usage,
            message.num_preemptions_total, message.step_duration_s, message.wall_time_s)
        for index, request_id in enumerate(message.request_ids):
            queue = self._queues.get(request_id)
            if queue is None:  # aborted here already; the scheduler's late outputs are moot
                continue
            finish_reason = message.finish_reasons[index]
            queue.put_nowait(EngineDelta(message.tokens_of(index).tolist(), finish_reason,
                                         message.error_messages[index]))
            if finish_reason:
                del self._queues[request_id]

    def fail_silent_requests(self) -> None:
        """End every open request with an error once the scheduler has been silent too long."""
        silent_s = self.seconds_since_last_message()
        if not self._queues or silent_s < self._dead_after_s:
            return
        message = f"the scheduler has sent nothing for {silent_s:.0f} s; the request was failed"
        logger.error("%s (%d requests)", message, len(self._queues))
        for queue in self._queues.values():
            queue.put_nowait(EngineDelta([], "error", message))
        self._queues.clear()

    async def _receive_loop(self) -> None:
        poll_ms = int(min(self._alive_timeout_s, 1.0) * 1000)
        while True:
            if not await self._outputs.poll(poll_ms, zmq.POLLIN):
                self.fail_silent_requests()
                continue
            frame = await self._outputs.recv(copy=True)
            try:
                self.handle_frame(frame)
            except Exception:  # a routing bug must not stop every other request's outputs
                logger.exception("error while routing scheduler outputs")

    def _send(self, message: AddRequest | AbortRequest) -> None:
        if self._requests is None:
            raise EngineUnavailableError("the engine client is not started")
        try:
            # NOBLOCK: a full or absent scheduler must never stall the event loop.
            self._requests.send(codec.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise EngineUnavailableError("the scheduler is not accepting requests (inbox full)") from exc
