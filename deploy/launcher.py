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
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import zmq

from deploy.cpu_isa import resolve_dtype
from deploy.devices import check_devices, visible_gpus, worker_env
from deploy.model_info import ModelError, needs_model_facts, read_model_info, resolve_model_facts
from deploy.node_group import GroupChannel
from deploy.placement import check_transport
from deploy.restarts import RestartBudget
from proto import codec, sockets
from proto.config import EngineConfig
from proto.errors import ProtocolError, ValidationError
from proto.messages import GroupLost, ProcessFailed, ProcessReady, RestartScheduler, RestartWorkers, StartGroup

log = logging.getLogger("conveyor.deploy")


class StartupError(RuntimeError):
    """A process did not become ready; the message names it and says why."""


@dataclass
class Child:
    name: str
    module: str
    extra_args: list[str]
    env: dict[str, str] = field(default_factory=dict)  # overrides, e.g. a worker's one GPU
    process: subprocess.Popen | None = None
    log_file: IO[bytes] | None = None

    @property
    def rank(self) -> int:
        """A worker's tensor-parallel rank (-1 for the other processes)."""
        return int(self.extra_args[1]) if self.module == "worker_proc" else -1

    def describe_exit(self) -> str:
        code = self.process.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        rank = f", tensor-parallel rank {self.rank}" if self.module == "worker_proc" else ""
        return f"{self.name} (pid {self.process.pid}{rank}) {how}"


class Stack:
    """Every conveyor process of one node, owned for the duration of a `with` block."""

    def __init__(self, config: EngineConfig, log_dir: Path | None = None) -> None:
        self.config = config
        self.log_dir = log_dir
        self.children: list[Child] = []
        self._context: zmq.Context | None = None
        self._control: zmq.Socket | None = None
        self._owns_runtime_dir = not config.runtime_dir
        self.num_protocol_errors = 0  # malformed control frames
        self.failure = ""  # why the stack is stopping, when a process died or reported failure
        self.restarts = RestartBudget(config.max_restarts, config.restart_window_s)
        self._kill_reasons: dict[int, str] = {}  # pid -> why the supervisor killed that worker
        self.num_frontend_restarts = 0  # handed to each new frontend for its process_restarts_total
        self._group: GroupChannel | None = None  # the supervisors' channel when nnodes > 1

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
            self.config = resolve_dtype(self.config, bool(gpus), os.environ)
        except (ModelError, ValidationError) as exc:
            raise StartupError(str(exc)) from exc
        log.info("dtype %s: %s", self.config.dtype, self.config.dtype_reason)
        if self._owns_runtime_dir:
            self.config = self.config.with_updates(runtime_dir=sockets.make_runtime_dir())
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
        argv = [sys.executable, "-m", child.module, "--config", self.config.to_json(), *child.extra_args]
        output: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            output = child.log_file = open(self.log_dir / f"{child.name}.log", "ab")
        # A new session: a terminal's Ctrl-C reaches only the supervisor, which stops children in order.
        child.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output,
                                         stderr=subprocess.STDOUT if output else None,
                                         start_new_session=True, env=_child_env(child.env))
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
        A RestartWorkers (the scheduler naming hung ranks) kills those ranks here."""
        frame = sockets.recv_ready(self._control, wait_s)
        message = None if frame is None else self.decode_control(frame)
        if isinstance(message, RestartWorkers):
            self._kill_ranks(message.ranks.tolist(), message.reason)
        elif isinstance(message, RestartScheduler):
            self._kill_hung_scheduler(message.pid, message.reason)
        elif isinstance(message, ProcessReady):  # a replaced process is back
            log.info("%s ready (pid %d) %s", message.name, message.pid, message.detail)
        return f"{message.name} reported: {message.message}" if isinstance(message, ProcessFailed) else ""

    def _follow_group(self) -> str:
        """Across nodes: node 0 replaces its group for a rank lost on another node and repeats the
        current generation; another node starts the group node 0 names. '' or why to stop."""
        if self._group is None:
            return ""
        self._group.poll_announce()
        message = self._group.receive()
        if message is None:
            return self._group.node0_silence()
        if isinstance(message, GroupLost) and message.generation == self.config.worker_generation:
            return self._replace_group(f"node {message.node_rank} lost a rank: {message.cause}")
        if isinstance(message, GroupLost):  # a group already replaced
            log.info("node %d lost a rank of old worker group %d: %s", message.node_rank,
                     message.generation, message.cause)
        if isinstance(message, StartGroup) and message.generation > self.config.worker_generation:
            return self._replace_group(f"node 0 started worker group {message.generation} "
                                       f"({message.cause})", message.generation)
        return ""

    def _workers(self) -> list[Child]:
        return [child for child in self.children if child.module == "worker_proc"]

    def _kill_ranks(self, ranks: list[int], reason: str) -> None:
        """Kill the named hung ranks of this node; a named rank on another node takes this node's
        whole group with it (its replacement on every node follows from the deaths)."""
        remote = [rank for rank in ranks if rank not in self.config.local_ranks]
        if remote:
            reason = f"{reason}; rank {remote[0]} runs on another node, so this node's group goes too"
        for child in self._workers():
            if (child.rank in ranks or remote) and child.process is not None and child.process.poll() is None:
                log.error("%s (pid %d, tensor-parallel rank %d) hangs: %s; killing it", child.name,
                          child.process.pid, child.rank, reason)
                self._kill_reasons[child.process.pid] = reason
                child.process.kill()

    def _kill_hung_scheduler(self, pid: int, reason: str) -> None:
        """The frontend heard nothing from scheduler `pid` for too long: kill it (the watch then
        replaces it). A report about a scheduler replaced meanwhile is ignored."""
        for child in self.children:
            if child.module == "scheduler_proc" and child.process is not None and child.process.pid == pid \
                    and child.process.poll() is None:
                log.error("scheduler (pid %d) hangs: %s; killing it", pid, reason)
                self._kill_reasons[pid] = reason
                child.process.kill()

    def _replace_scheduler(self, dead: Child) -> str:
        """The scheduler died (or was killed for hanging): start a new one and a fresh worker group
        with it (the workers' step sockets and KV cache belonged to the lost one). The frontend
        resubmits its requests once the new scheduler talks. '' once the new processes are ready,
        else why the stack must stop (--max-restarts reached, or they did not start)."""
        cause = dead.describe_exit()
        killed_for = self._kill_reasons.pop(dead.process.pid, "")
        if killed_for:
            cause = f"{cause} after it hung ({killed_for})"
        if not self.restarts.allow(cause):
            return self.restarts.exhausted(cause)
        log.error("%s; replacing the scheduler and the worker group (restart %d, at most %d within "
                  "%.0f s)", cause, self.restarts.num_restarts_total, self.restarts.max_restarts,
                  self.restarts.window_s)
        self.config = self.config.with_updates(worker_generation=self.config.worker_generation + 1)
        engine = [dead, *self._workers()]
        for child in engine:
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
            if child.process is not None:
                child.process.wait()
            if child.log_file is not None:
                child.log_file.close()
            self._spawn(child)
        try:
            self._wait_ready({child.name for child in engine})
        except StartupError as exc:
            return f"the replacement scheduler did not start: {exc}"
        return ""

    def _replace_workers(self, dead: Child) -> str:
        """A worker died (or was killed for hanging): start a fresh group of this node's workers,
        the survivors killed first (the group's collectives and KV cache went with the dead one).
        Returns '' once replaced, else why the stack must stop (--max-restarts reached)."""
        cause = dead.describe_exit()
        killed_for = self._kill_reasons.pop(dead.process.pid, "")
        if killed_for:
            cause = f"{cause} after it hung ({killed_for})"
        if self.config.node_rank == 0:
            return self._replace_group(cause)
        # Only node 0 picks the next group: stop ours, tell it, and start the one it names.
        log.error("%s; stopping this node's ranks of worker group %d and asking node 0 for a new "
                  "group", cause, self.config.worker_generation)
        self._stop_workers()
        self._group.report_lost(self.config.worker_generation, cause)
        return ""

    def _replace_group(self, cause: str, generation: int = -1) -> str:
        """Start this node's ranks of a fresh worker group: `generation` (another node: the one
        node 0 named), or node 0's next one, announced to every other node. Returns '' once
        started, else why the stack must stop (--max-restarts reached on this node)."""
        if not self.restarts.allow(cause):
            return self.restarts.exhausted(cause)
        generation = self.config.worker_generation + 1 if generation < 0 else generation
        log.error("%s; replacing the worker group with group %d (restart %d, at most %d within %.0f s)",
                  cause, generation, self.restarts.num_restarts_total, self.restarts.max_restarts,
                  self.restarts.window_s)
        self._stop_workers()
        self.config = self.config.with_updates(worker_generation=generation)
        for child in self._workers():
            self._spawn(child)
        if self._group is not None and self.config.node_rank == 0:
            self._group.announce(generation, cause)
        return ""

    def _stop_workers(self) -> None:
        """Kill this node's workers and reap them (none left behind to join a later group); a
        stopped worker has no process until the next group starts it."""
        for child in self._workers():
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
            if child.process is not None:
                child.process.wait()
            if child.log_file is not None:
                child.log_file.close()
            child.process = None

    def _restart_frontend(self, dead: Child) -> str:
        """The frontend died, and its clients' connections with it (the scheduler aborts their
        requests itself, seeing the process gone): start a new one on the same port, told how
        many restarts came before it. '' once started, else why the stack must stop."""
        cause = dead.describe_exit()
        if not self.restarts.allow(cause):
            return self.restarts.exhausted(cause)
        log.error("%s; restarting the frontend (restart %d, at most %d within %.0f s)", cause,
                  self.restarts.num_restarts_total, self.restarts.max_restarts, self.restarts.window_s)
        self.num_frontend_restarts += 1
        dead.extra_args = ["--restarts", str(self.num_frontend_restarts)]
        if dead.log_file is not None:
            dead.log_file.close()
        self._spawn(dead)
        return ""

    def decode_control(self, frame: bytes) -> ProcessReady | ProcessFailed | None:
        """A control frame's message; a malformed one (or another channel's) is logged, counted, None."""
        try:
            return codec.decode(frame, sockets.CONTROL_MESSAGES)
        except ProtocolError as exc:
            self.num_protocol_errors += 1
            log.warning("ignoring a malformed control frame (%d so far): %s", self.num_protocol_errors, exc)
            return None

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
        if self._group is not None:
            self._group.close()  # before the context: its ZAP thread owns a socket there
            self._group = None
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


def _child_env(overrides: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, **overrides)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
