"""Running the app under uvicorn: our own listen socket, readiness report, SIGTERM drain."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
import zmq

from frontend.state import ServerState
from proto import sockets
from proto.control import ProcessFailed, ProcessReady, RestartScheduler

logger = logging.getLogger(__name__)

PROCESS_NAME = "frontend"
UVICORN_GRACE_S = 2.0  # after our own drain, for responses still being written
_PR_SET_PDEATHSIG = 1


class SupervisorLink:
    """PUSH to the supervisor's CONTROL channel: one ProcessReady or ProcessFailed, ever, and a
    RestartScheduler for each scheduler that hangs."""

    def __init__(self, runtime_dir: str) -> None:
        self._context = zmq.Context()
        self._sock = sockets.connect(self._context, zmq.PUSH, runtime_dir, sockets.CONTROL)

    def ready(self, detail: str) -> None:
        sockets.send(self._sock, ProcessReady(PROCESS_NAME, os.getpid(), detail))

    def restart_scheduler(self, pid: int, reason: str) -> None:
        sockets.send(self._sock, RestartScheduler(pid, reason))

    def failed(self, message: str) -> None:
        sockets.send(self._sock, ProcessFailed(PROCESS_NAME, os.getpid(), message))

    def close(self) -> None:
        self._sock.close(linger=1000)  # let a last ProcessFailed reach the supervisor
        self._context.term()


def exit_with_parent() -> None:
    """Get SIGTERM (and so drain and exit) when the supervisor dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())


def bind_listen_socket(host: str, port: int, client_timeout_s: float = 0.0) -> socket.socket:
    """Bind here rather than in uvicorn, so that a busy port is a clear error we can report.
    `client_timeout_s`: where the OS has TCP_USER_TIMEOUT (Linux), every accepted connection
    whose sent data stays unacknowledged that long (a client that stopped reading: its window is
    shut) is closed by the kernel; a response the frontend gave up on then frees its socket and
    buffers too, instead of waiting for the peer to leave."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if client_timeout_s > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):  # inherited by accepted sockets
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(client_timeout_s * 1000))
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM/SIGINT: /health and new requests get 503 while
    in-flight requests run on for up to `shutdown_timeout_s`; the rest are then aborted (each
    still gets a terminal response) before uvicorn stops. A second signal aborts what is still in
    flight at once (each request still answered) and stops within UVICORN_GRACE_S; a third
    stops without waiting for anything."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout_s: float,
                 on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._state = state
        self._shutdown_timeout_s = shutdown_timeout_s
        self._on_started = on_started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._hurried = False  # a second signal came: in-flight requests are aborted now

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own handler would re-raise the signal at exit; a drained exit is a clean exit.
        if self._loop is None or self._hurried:
            self.should_exit = self.force_exit = True
            return
        if self._state.draining:
            logger.info("got signal %d again: aborting %d in-flight requests now", sig, self._state.num_in_flight)
            self._hurried = True
            self._loop.call_soon_threadsafe(self._start_drain, 0.0)
            return
        logger.info("got signal %d: draining %d in-flight requests (up to %.0f s)",
                    sig, self._state.num_in_flight, self._shutdown_timeout_s)
        self._state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain, self._shutdown_timeout_s)

    def _start_drain(self, timeout_s: float) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
        self._drain_task = asyncio.create_task(self._drain(timeout_s))

    async def _drain(self, timeout_s: float) -> None:
        await self._wait_idle(timeout_s)
        if self._state.num_in_flight:
            logger.warning("shutdown: aborting %d requests", self._state.num_in_flight)
            self._state.abort_all("the server is shutting down")
            await self._wait_idle(UVICORN_GRACE_S)
        self.should_exit = True

    async def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
