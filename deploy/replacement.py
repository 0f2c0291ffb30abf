"""How the supervisor replaces a lost process: a worker group (on this node, or on every node in
the group node 0's supervisor names), the frontend, or the scheduler with its worker group, each
against the one restart budget (deploy/restarts.py), with a log line naming the process and cause.

`Replacements` is the part of `deploy.launcher.Stack` that does it; it works on the Stack's
children, config, restart budget and group channel, and on its `_spawn` and `_ready_deadlines`
(a replaced process must report ready within --ready-timeout, or the watch kills it).
"""

from __future__ import annotations

import logging
import time

from deploy.children import Child
from proto.control import GroupLost, StartGroup

log = logging.getLogger("conveyor.deploy")


class Replacements:
    """Mixed into Stack: replacing what the watch found lost."""

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

    def _exit_cause(self, dead: Child) -> str:
        """How `dead` exited, and why the supervisor killed it if it did (`_kill_reasons`)."""
        killed_for = self._kill_reasons.pop(dead.process.pid, "")
        return f"{dead.describe_exit()} {killed_for}" if killed_for else dead.describe_exit()

    def _workers(self) -> list[Child]:
        return [child for child in self.children if child.module == "worker_proc"]

    def _kill_ranks(self, ranks: list[int], reason: str) -> None:
        """Kill the named ranks of this node (they hung or raised in a step: `reason` says which); a
        named rank on another node takes this node's whole group with it (its replacement on every
        node follows from the deaths)."""
        remote = [rank for rank in ranks if rank not in self.config.local_ranks]
        if remote:
            reason = f"{reason}; rank {remote[0]} runs on another node, so this node's group goes too"
        for child in self._workers():
            if (child.rank in ranks or remote) and child.process is not None and child.process.poll() is None:
                log.error("%s (pid %d, tensor-parallel rank %d) is given up by the scheduler: %s; killing it",
                          child.name, child.process.pid, child.rank, reason)
                self._kill_reasons[child.process.pid] = f"after the scheduler gave it up ({reason})"
                child.process.kill()

    def _kill_hung_scheduler(self, pid: int, reason: str) -> None:
        """The frontend heard nothing from scheduler `pid` for too long: kill it (the watch then
        replaces it). A report about a scheduler replaced meanwhile is ignored."""
        for child in self.children:
            if child.module == "scheduler_proc" and child.process is not None and child.process.pid == pid \
                    and child.process.poll() is None:
                log.error("scheduler (pid %d) hangs: %s; killing it", pid, reason)
                self._kill_reasons[pid] = f"after it hung ({reason})"
                child.process.kill()

    def _replace_scheduler(self, dead: Child) -> str:
        """The scheduler died (or was killed for hanging): start a new one and a fresh worker group
        with it (the workers' step sockets and KV cache belonged to the lost one), announced to the
        other nodes, whose ranks join it. The frontend resubmits its requests once the new
        scheduler talks. The watch goes on meanwhile (the frontend and the other nodes are served)
        and holds the new processes to --ready-timeout. '' once started, else why the stack must
        stop (--max-restarts reached)."""
        cause = self._exit_cause(dead)
        if not self.restarts.allow(cause):
            return self.restarts.exhausted(cause)
        self.num_restarts["scheduler"] += 1
        self.num_worker_restarts_before_scheduler = self.num_restarts["worker"]
        generation = self.config.worker_generation + 1
        log.error("%s; replacing the scheduler and the worker group with group %d (%s)", cause,
                  generation, self.restarts.describe())
        self.config = self.config.with_updates(worker_generation=generation)
        for child in [dead, *self._workers()]:
            _kill_and_reap(child)
            self._spawn(child)
            self._ready_deadlines[child.name] = time.monotonic() + self.config.ready_timeout_s
        if self._group is not None:
            self._group.announce(generation, f"the scheduler was replaced: {cause}")
        return ""

    def _replace_workers(self, dead: Child) -> str:
        """A worker died (or was killed for hanging): start a fresh group of this node's workers,
        the survivors killed first (the group's collectives and KV cache went with the dead one).
        Returns '' once replaced, else why the stack must stop (--max-restarts reached)."""
        cause = self._exit_cause(dead)
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
        self.num_restarts["worker"] += 1
        generation = self.config.worker_generation + 1 if generation < 0 else generation
        log.error("%s; replacing the worker group with group %d (%s)", cause, generation,
                  self.restarts.describe())
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
            _kill_and_reap(child)
            child.process = None

    def _restart_frontend(self, dead: Child) -> str:
        """The frontend died, and its clients' connections with it (the scheduler aborts their
        requests itself, seeing the process gone): start a new one on the same port, told how
        many restarts came before it. '' once started, else why the stack must stop."""
        cause = self._exit_cause(dead)
        if not self.restarts.allow(cause):
            return self.restarts.exhausted(cause)
        log.error("%s; restarting the frontend (%s)", cause, self.restarts.describe())
        self.num_restarts["frontend"] += 1
        counts = dict(self.num_restarts, worker=self.num_worker_restarts_before_scheduler)
        dead.extra_args = [f"--{kind}-restarts={count}" for kind, count in counts.items()]
        _kill_and_reap(dead)
        self._spawn(dead)
        # The watch keeps serving the engine meanwhile, so it is the watch that holds the new
        # frontend to --ready-timeout (kill_unready_restarts).
        self._ready_deadlines[dead.name] = time.monotonic() + self.config.ready_timeout_s
        return ""

    def _kill_unready_restarts(self) -> None:
        """Kill a restarted process that has not reported ready within --ready-timeout (the watch
        then restarts it again, against the same budget)."""
        now = time.monotonic()
        for child in self.children:
            deadline = self._ready_deadlines.get(child.name)
            if deadline is None or now < deadline:
                continue
            del self._ready_deadlines[child.name]
            if child.process is not None and child.process.poll() is None:
                reason = f"not ready {self.config.ready_timeout_s:.0f} s after its restart (--ready-timeout)"
                log.error("%s (pid %d) is %s; killing it", child.name, child.process.pid, reason)
                self._kill_reasons[child.process.pid] = f"after it was {reason}"
                child.process.kill()


def _kill_and_reap(child: Child) -> None:
    """SIGKILL the child if it still runs, reap it, and close its log: ready to be started again."""
    if child.process is not None and child.process.poll() is None:
        child.process.kill()
    if child.process is not None:
        child.process.wait()
    if child.log_file is not None:
        child.log_file.close()
