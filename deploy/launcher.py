"""One launcher for production and tests: start every process, wait for ready, stop them all.

`Stack` is a context manager: `with Stack(config) as stack:` starts this node's processes as
fresh Python processes (node 0: the scheduler, its share of the tensor-parallel workers and the
frontend; any other node: its workers only, which reach node 0 over TCP), waits until each
reports ProcessReady on the control channel, and on exit stops them all (frontend first so
in-flight requests drain) and kills whatever outlives the shutdown timeout. While it watches, a
lost worker group, frontend or scheduler (with its worker group) is replaced, within one restart
budget (deploy/restarts.py); across nodes every node replaces its own ranks when any rank is lost,
in the group that node 0's supervisor names (deploy/node_group.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import zmq

from deploy.allocator import allocator_env
from deploy.cpu_isa import resolve_dtype
from deploy.devices import check_devices, lowest_compute_capability, visible_gpus, worker_env
from deploy.model_info import ModelError, needs_model_facts, read_model_info, resolve_model_facts
from deploy.node_group import GroupChannel
from deploy.placement import check_transport
from deploy.children import Child, ExitWatch, StartupError
from deploy.replacement import Replacements
from deploy.restarts import RestartBudget
from deploy.runtime_dirs import make_owned_runtime_dir, remove_stale_runtime_dirs
from proto import codec, sockets
from proto.config import API_KEY_ENV, EngineConfig
from proto.errors import ProtocolError, ValidationError
from proto.control import ProcessFailed, ProcessReady, RestartScheduler, RestartWorkers

log = logging.getLogger("conveyor.deploy")


class Stack(Replacements):
    """Every conveyor process of one node, owned for the duration of a `with` block."""

    def __init__(self, config: EngineConfig, log_dir: Path | None = None,
                 should_stop: Callable[[], bool] = lambda: False, wakeup: socket.socket | None = None) -> None:
        """`should_stop` (e.g. SIGTERM received) also ends the wait for start-up: StartupError.
        `wakeup`: readable when a signal arrived (signal.set_wakeup_fd's other end), so that
        watch() acts on a stop at once rather than at the end of its poll slice."""
        self.config = config
        self.log_dir = log_dir
        self._should_stop = should_stop
        self._wakeup = wakeup
        self.children: list[Child] = []
        self._context: zmq.Context | None = None
        self._control: zmq.Socket | None = None
        self._owns_runtime_dir = not config.runtime_dir
        self.num_protocol_errors = 0  # malformed control frames
        self.failure = ""  # why the stack is stopping, when a process died or reported failure
        self.restarts = RestartBudget(config.max_restarts, config.restart_window_s)
        self._kill_reasons: dict[int, str] = {}  # pid -> why the supervisor killed it ("after ...")
        self._ready_deadlines: dict[str, float] = {}  # restarted child -> when it must be ready
        # Replacements by process kind, handed to each new frontend for its process_restarts_total;
        # of the worker groups, those replaced before the running scheduler started (it counts the
        # rest itself, and reports them to the frontend).
        self.num_restarts = {"frontend": 0, "scheduler": 0, "worker": 0}
        self.num_worker_restarts_before_scheduler = 0
        self._group: GroupChannel | None = None  # the supervisors' channel when nnodes > 1
        self._exits = ExitWatch()

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
        gpus = visible_gpus()
        try:
            check_devices(self.config, gpus)
            check_transport(self.config)
            if needs_model_facts(self.config):  # not from `conveyor serve`
                self.config = resolve_model_facts(self.config, read_model_info(Path(self.config.model)))
            capability = lowest_compute_capability(gpus) if gpus and self.config.dtype == "auto" else None
            self.config = resolve_dtype(self.config, bool(gpus), os.environ, gpu_capability=capability)
            malloc = allocator_env(dict(os.environ)).get("LD_PRELOAD", "glibc's malloc")
        except (ModelError, ValidationError) as exc:
            raise StartupError(str(exc)) from exc
        log.info("dtype %s, KV cache %s: %s", self.config.dtype, self.config.kv_dtype, self.config.dtype_reason)
        if not gpus:
            log.info("CPU workers' allocator: %s (CONVEYOR_MALLOC=system|tcmalloc|auto)", malloc)
        if self._owns_runtime_dir:
            stale = remove_stale_runtime_dirs()
            if stale:
                log.info("removed %d runtime directories of supervisors that are gone: %s", len(stale),
                         ", ".join(str(path) for path in stale))
            self.config = self.config.with_updates(runtime_dir=make_owned_runtime_dir())
        self._context = zmq.Context()
        self._control = sockets.bind(self._context, zmq.PULL, self.config.runtime_dir, sockets.CONTROL,
                                     sockets.max_frame_bytes(self.config))
        if self.config.nnodes > 1:
            self._group = GroupChannel(self._context, self.config)
        self.children = self._plan_children(gpus)
        for child in self.children:
            self._spawn(child)
        self._wait_ready({child.name for child in self.children})

    def _plan_children(self, gpus: list[str]) -> list[Child]:
        """Node 0: scheduler, workers, frontend; other nodes: their workers only."""
        config = self.config
        workers = [Child(f"worker{rank}", "worker_proc", ["--rank", str(rank)],
                         worker_env(config, local_rank, gpus))
                   for local_rank, rank in enumerate(config.local_ranks)]
        if config.node_rank > 0:
            return workers
        return [Child("scheduler", "scheduler_proc", []), *workers, Child("frontend", "frontend", [])]

    def _spawn(self, child: Child) -> None:
        # The API key reaches the frontend alone, in its environment: command lines are world-readable.
        # The config's key is the one: an API_KEY_ENV inherited from here is no child's business.
        config, env = self.config.with_updates(api_key=""), _child_env(child.env)
        env.pop(API_KEY_ENV, None)
        if child.module == "frontend" and self.config.api_key:
            env[API_KEY_ENV] = self.config.api_key
        argv = [sys.executable, "-m", child.module, "--config", config.to_json(), *child.extra_args]
        output: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = child.log_file = open(self.log_dir / f"{child.name}.log", "ab")
        # A new session: a terminal's Ctrl-C reaches only the supervisor, which stops children in order.
        child.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output,
                                         stderr=subprocess.STDOUT if output else None,
                                         start_new_session=True, env=env)
        log.info("started %s (pid %d)", child.name, child.process.pid)

    def _wait_ready(self, pending: set[str]) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while pending:
            if self._should_stop():
                raise StartupError(f"asked to stop while {', '.join(sorted(pending))} started")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StartupError(f"{', '.join(sorted(pending))} not ready after "
                                   f"{self.config.ready_timeout_s:.0f} s (--ready-timeout)")
            frame = sockets.recv_ready(self._control, min(remaining, 0.5))
            if frame is None:
                self._raise_if_any_exited(pending)
                continue
            message = self.decode_control(frame)
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
        """Block until should_stop(), or until a child dies or reports ProcessFailed (e.g. the
        scheduler naming a worker rank that did not answer a step); return why, for the log. A
        failure is kept in self.failure, which makes stop() fail fast instead of draining."""
        while not should_stop():
            reported = self._reported_failure(poll_s) or self._follow_group()
            if should_stop():  # a stop asked for meanwhile (and a second one's SIGTERMs): no replacing
                break
            self._kill_unready_restarts()
            dead = self.dead_child()
            if dead is not None and dead.module in self._REPLACERS and not reported:
                reported = getattr(self, self._REPLACERS[dead.module])(dead)
                if not reported:
                    continue
                dead = None
            if dead is not None or reported:
                detail = "; ".join(part for part in (dead.describe_exit() if dead else "", reported) if part)
                self.failure = f"{detail}; stopping every process{self._log_hint(dead) if dead else ''}"
                return self.failure
        return "shutdown requested"

    _REPLACERS = {"worker_proc": "_replace_workers", "frontend": "_restart_frontend",
                  "scheduler_proc": "_replace_scheduler"}

    def _reported_failure(self, wait_s: float) -> str:
        """A ProcessFailed that arrives on the control channel within wait_s, as text; else ''.
        A RestartWorkers (the scheduler naming hung ranks) kills those ranks here. A child's exit
        and a message on the supervisors' group channel end the wait too, so that a lost process
        here or a lost rank on another node is handled at once."""
        poller = zmq.Poller()
        wakeup = [] if self._wakeup is None else [self._wakeup]
        for readable in [self._control, *self._group_sockets(), *self._exits.fds(self.children), *wakeup]:
            poller.register(readable, zmq.POLLIN)
        ready = dict(poller.poll(int(wait_s * 1000)))
        if self._wakeup is not None and self._wakeup.fileno() in ready:
            _drain(self._wakeup)
        frame = sockets.recv_ready(self._control, 0.0)
        message = None if frame is None else self.decode_control(frame)
        if isinstance(message, RestartWorkers):
            self._kill_ranks(message.ranks.tolist(), message.reason)
        elif isinstance(message, RestartScheduler):
            self._kill_hung_scheduler(message.pid, message.reason)
        elif isinstance(message, ProcessReady):  # a replaced process is back
            self._ready_deadlines.pop(message.name, None)
            log.info("%s ready (pid %d) %s", message.name, message.pid, message.detail)
        return f"{message.name} reported: {message.message}" if isinstance(message, ProcessFailed) else ""

    def _group_sockets(self) -> list[zmq.Socket]:
        return [] if self._group is None else [self._group.socket]

    def decode_control(self, frame: bytes) -> ProcessReady | ProcessFailed | None:
        """A control frame's message; a malformed one (or another channel's) is logged, counted, None."""
        try:
            return codec.decode(frame, sockets.CONTROL_MESSAGES)
        except ProtocolError as exc:
            self.num_protocol_errors += 1
            log.warning("ignoring a malformed control frame (%d so far): %s", self.num_protocol_errors, exc)
            return None

    def hurry(self) -> None:
        """A second stop signal: every live child gets SIGTERM now (the frontend, a second one,
        aborts what is in flight and exits; the others stop), so stop() waits for little."""
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Frontend first: on SIGTERM its /health turns 503 and it drains in-flight requests; then
        the engine processes. After a failure there is nothing to wait for: every process gets
        SIGTERM at once, frontend first (the scheduler then ends the in-flight requests)."""
        frontend = [c for c in self.children if c.name == "frontend"]
        engine = [c for c in self.children if c.name != "frontend"]
        if self.failure:
            _terminate(frontend + engine, self.config.shutdown_timeout_s + 5.0)
        else:
            _terminate(frontend, self.config.shutdown_timeout_s + 5.0)
            _terminate(engine, 10.0)
        for child in self.children:
            if child.log_file is not None:
                child.log_file.close()
        self._exits.close()
        if self._group is not None:
            self._group.close()  # before the context: its ZAP thread owns a socket there
            self._group = None
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None
        if self._owns_runtime_dir and self.config.runtime_dir:
            shutil.rmtree(self.config.runtime_dir, ignore_errors=True)


def _drain(wakeup: socket.socket) -> None:
    """Read the signal numbers set_wakeup_fd wrote (the handlers themselves have run)."""
    try:
        while wakeup.recv(4096):
            pass
    except BlockingIOError:
        pass


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


def _child_env(overrides: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, **overrides)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
