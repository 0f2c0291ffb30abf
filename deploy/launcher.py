"""One launcher for production and tests: start every process, wait for ready, stop them all.

`Stack` is a context manager: `with Stack(config) as stack:` starts the scheduler, one worker per
tensor-parallel rank and the frontend as fresh Python processes, waits until each reports
ProcessReady on the control channel, and on exit stops them all (frontend first so in-flight
requests drain) and kills whatever outlives the shutdown timeout.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import zmq

from proto import codec, sockets
from proto.config import EngineConfig
from proto.errors import ProtocolError
from proto.messages import ProcessFailed, ProcessReady

log = logging.getLogger("conveyor.deploy")


class StartupError(RuntimeError):
    """A process did not become ready; the message names it and says why."""


@dataclass
class Child:
    name: str
    module: str
    extra_args: list[str]
    process: subprocess.Popen | None = None
    log_file: IO[bytes] | None = None


class Stack:
    """Every conveyor process of one node, owned for the duration of a `with` block."""

    def __init__(self, config: EngineConfig, log_dir: Path | None = None) -> None:
        self.config = config
        self.log_dir = log_dir
        self.children: list[Child] = []
        self._context: zmq.Context | None = None
        self._control: zmq.Socket | None = None
        self._owns_runtime_dir = not config.runtime_dir

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def __enter__(self) -> "Stack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._owns_runtime_dir:
            self.config = self.config.with_updates(runtime_dir=sockets.make_runtime_dir())
        self._context = zmq.Context()
        self._control = sockets.bind(self._context, zmq.PULL, self.config.runtime_dir, sockets.CONTROL)
        self.children = [Child("scheduler", "scheduler_proc", [])]
        self.children += [Child(f"worker{rank}", "worker_proc", ["--rank", str(rank)])
                          for rank in range(self.config.tensor_parallel_size)]
        self.children.append(Child("frontend", "frontend", []))
        for child in self.children:
            self._spawn(child)
        self._wait_ready({child.name for child in self.children})

    def _spawn(self, child: Child) -> None:
        argv = [sys.executable, "-m", child.module, "--config", self.config.to_json(), *child.extra_args]
        output: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = child.log_file = open(self.log_dir / f"{child.name}.log", "ab")
        # A new session: a terminal's Ctrl-C reaches only the supervisor, which stops children in order.
        child.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output,
                                         stderr=subprocess.STDOUT if output else None,
                                         start_new_session=True, env=_child_env())
        log.info("started %s (pid %d)", child.name, child.process.pid)

    def _wait_ready(self, pending: set[str]) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StartupError(f"{', '.join(sorted(pending))} not ready after "
                                   f"{self.config.ready_timeout_s:.0f} s (--ready-timeout)")
            frame = sockets.recv_ready(self._control, min(remaining, 0.5))
            if frame is None:
                self._raise_if_any_exited(pending)
                continue
            try:
                message = codec.decode(frame)
            except ProtocolError as exc:
                log.warning("ignoring a malformed control frame: %s", exc)
                continue
            if isinstance(message, ProcessFailed):
                raise StartupError(f"{message.name} failed to start: {message.message}")
            if isinstance(message, ProcessReady):
                log.info("%s ready (pid %d) %s", message.name, message.pid, message.detail)
                pending.discard(message.name)

    def _raise_if_any_exited(self, pending: set[str]) -> None:
        for child in self.children:
            code = child.process.poll() if child.process else None
            if code is not None:
                state = "before it was ready" if child.name in pending else "during start-up"
                raise StartupError(f"{child.name} exited with code {code} {state}"
                                   f"{self._log_hint(child)}")

    def _log_hint(self, child: Child) -> str:
        return f" (log: {self.log_dir / (child.name + '.log')})" if self.log_dir else ""

    def dead_child(self) -> Child | None:
        """The first required process that has exited, if any."""
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                return child
        return None

    def watch(self, should_stop: Callable[[], bool], poll_s: float = 0.5) -> str:
        """Block until should_stop() or a child dies; return why, for the log."""
        while not should_stop():
            dead = self.dead_child()
            if dead is not None:
                return (f"{dead.name} (pid {dead.process.pid}) exited with code "
                        f"{dead.process.returncode}; stopping every process{self._log_hint(dead)}")
            time.sleep(poll_s)
        return "shutdown requested"

    def stop(self) -> None:
        """Frontend first (it drains in-flight requests on SIGTERM), then the engine processes."""
        frontend = [c for c in self.children if c.name == "frontend"]
        engine = [c for c in self.children if c.name != "frontend"]
        _terminate(frontend, self.config.shutdown_timeout_s + 5.0)
        _terminate(engine, 10.0)
        for child in self.children:
            if child.log_file is not None:
                child.log_file.close()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None
        if self._owns_runtime_dir and self.config.runtime_dir:
            shutil.rmtree(self.config.runtime_dir, ignore_errors=True)


def _terminate(children: list[Child], timeout_s: float) -> None:
    alive = [c for c in children if c.process is not None and c.process.poll() is None]
    for child in alive:
        child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in alive:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0f s; killing it", child.name, timeout_s)
            child.process.kill()
            child.process.wait()


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
