"""The scheduler's link to its worker group: the step channels (a plan socket per rank, one results
socket), gathering a new group's WorkerReady, and each step's answers from every rank. Also the
two frame helpers the loop's own sockets share with these: FrameReader (decode, count what is
dropped) and send_frame (send within a deadline)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import zmq

from proto import codec, sockets, transport
from proto.config import EngineConfig
from proto.errors import ProtocolError
from proto.messages import StepResult, WorkerReady
from proto.processes import PidFds, process_alive
from scheduler_proc.rank_progress import RankProgress

Message = TypeVar("Message")

logger = logging.getLogger(__name__)

POLL_SLICE_S = 0.5  # longest blocking wait before re-checking stop requests and the parent


class FrameReader:
    """Decodes frames into the messages a read expects; anything else is counted, not raised."""

    def __init__(self) -> None:
        self.num_protocol_errors = 0

    def decode(self, frame: bytes | None, expected: type[Message] | tuple[type, ...]) -> Message | None:
        """The frame's message if it is one of `expected` (this read's types), else None, counted."""
        if frame is None:
            return None
        try:
            return codec.decode(frame, expected)
        except ProtocolError as exc:
            self.count_bad(f"dropped a malformed frame: {exc}")
            return None

    def count_bad(self, what: str) -> None:
        self.num_protocol_errors += 1
        logger.warning("%s (%d protocol errors so far)", what, self.num_protocol_errors)


def send_frame(sock: zmq.Socket, frame: bytes, deadline: float, give_up: Callable[[], bool]) -> bool:
    """Send without blocking past `deadline` or `give_up()` (asked once per poll slice); False if
    not sent."""
    while True:
        try:
            sock.send(frame, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0 or give_up():
                return False
            sock.poll(int(min(remaining_s, POLL_SLICE_S) * 1000), zmq.POLLOUT)


class WorkerGroup:
    """The serving group's sockets, ranks' pids and generation. `should_exit` ends every wait;
    `while_waiting` runs between poll slices of the long waits (the frontend is served meanwhile)."""

    def __init__(self, config: EngineConfig, context: zmq.Context, reader: FrameReader,
                 should_exit: Callable[[], bool]) -> None:
        self.config = config
        self.generation = -1  # the serving group's (WorkerReady.generation); stamped on plans
        self.pids: dict[int, int] = {}  # rank -> pid of the group serving now
        self._exits = PidFds()  # of the local ranks: a poll ends at a death
        self._context = context
        self._reader = reader
        self._should_exit = should_exit
        self._guard: transport.KeyGuard | None = None  # CURVE's ZAP handler, multi-node with keys
        self._plans: list[zmq.Socket] = []
        self._results: zmq.Socket | None = None

    def open(self) -> None:
        config, ctx = self.config, self._context
        max_frame_bytes = sockets.max_frame_bytes(config)
        # Step channels are tcp:// on the master address when the worker ranks span nodes, CURVE
        # with --transport-keys: the ZAP handler runs before the first bind.
        if self._guard is None:
            self._guard = sockets.guard_step_channels(ctx, config)
        self._plans = [sockets.bind_channel(ctx, zmq.PUSH, config, sockets.plan_channel(rank), self._guard)
                       for rank in range(config.tensor_parallel_size)]
        self._results = sockets.bind_channel(ctx, zmq.PULL, config, sockets.RESULTS, self._guard, max_frame_bytes)

    def reopen(self) -> None:
        """Fresh plan and result sockets for a new group: nothing queued for or sent by the lost
        group can reach the new one."""
        self._close_sockets()
        self.open()

    def close(self) -> None:
        self._exits.close()
        if self._guard is not None:
            self._guard.stop()  # first: its thread's socket lives in the context the loop destroys
            self._guard = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (*self._plans, self._results):
            if sock is not None:
                sock.close(linger=0)
        self._plans, self._results = [], None

    def gather(self, while_waiting: Callable[[], None]) -> tuple[int | None, str]:
        """(min over ranks of the reported KV blocks, "") once every rank of one group newer than
        the last is ready; (None, why) on timeout or too few blocks; (None, "") when told to exit."""
        num_ranks, timeout_s = self.config.tensor_parallel_size, self.config.ready_timeout_s
        deadline = time.monotonic() + timeout_s
        blocks_by_rank: dict[int, int] = {}
        dtype_by_rank: dict[int, str] = {}
        generation = self.generation + 1  # the lowest one that may serve next
        while len(blocks_by_rank) < num_ranks and not self._should_exit():
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                break
            while_waiting()
            # Only WorkerReady is expected now: a StepResult here is counted as a protocol error.
            ready = self._reader.decode(sockets.recv_ready(self._results, min(remaining_s, POLL_SLICE_S)),
                                        WorkerReady)
            if ready is None:
                continue
            if not 0 <= ready.rank < num_ranks:
                self._reader.count_bad(f"unexpected {ready!r:.120} while waiting for workers")
                continue
            if ready.generation < generation:  # a rank of the lost group (or an older one)
                self._reader.count_bad(f"ignored worker rank {ready.rank} (pid {ready.pid}) of worker group "
                                       f"{ready.generation}: waiting for group {generation} or later")
                continue
            if ready.generation > generation:  # a later group replaced the one being gathered
                generation, blocks_by_rank, dtype_by_rank = ready.generation, {}, {}
            logger.info("worker rank %d (pid %d) ready with %d KV blocks", ready.rank, ready.pid,
                        ready.num_kv_blocks)
            blocks_by_rank[ready.rank] = ready.num_kv_blocks
            dtype_by_rank[ready.rank] = f"{ready.dtype} (KV cache {ready.kv_cache_dtype or ready.dtype})"
            self.pids[ready.rank] = ready.pid
        if self._should_exit():
            return None, ""
        missing = [rank for rank in range(num_ranks) if rank not in blocks_by_rank]
        if missing:
            num_refused = self._guard.num_refused if self._guard else 0
            refused = (f"; {num_refused} peers were refused for a CURVE key that is not this "
                       "deployment's (--transport-keys)" if num_refused else "")
            return None, f"worker ranks {missing} did not report ready within {timeout_s} s{refused}"
        # Ranks of different dtypes would fail at the first collective; of different KV dtypes they
        # would compute each head group's attention differently and hold different context per GiB.
        if len(set(dtype_by_rank.values())) > 1:
            dtypes = ", ".join(f"rank {rank} {dtype}" for rank, dtype in sorted(dtype_by_rank.items()))
            return None, (f"worker ranks disagree on the dtype ({dtypes}): --dtype auto and "
                          f"--kv-cache-dtype auto decide on each node by its own CPU; pass the same --dtype "
                          f"and --kv-cache-dtype on every node")
        self.generation = generation
        num_kv_blocks = min(blocks_by_rank.values())
        if num_kv_blocks < 1:
            return None, f"workers reported {blocks_by_rank} KV blocks by rank; need at least 1"
        return num_kv_blocks, ""

    def send_plan(self, frame: bytes, deadline: float) -> int | None:
        """The same encoded plan to every rank; the first rank that did not take it, else None."""
        for rank, sock in enumerate(self._plans):
            if not send_frame(sock, frame, deadline, lambda: self._should_exit() or bool(self.dead_ranks([rank]))):
                return rank
        return None

    def local_pids(self) -> dict[int, int]:
        """rank -> pid of the serving group's ranks on this node (node 0 runs ranks
        0..workers_per_node-1); the others' pids are of processes on other machines."""
        return {rank: pid for rank, pid in self.pids.items() if rank < self.config.workers_per_node}

    def watch_exits(self, poller: zmq.Poller) -> dict[int, int]:
        """Register the local ranks' pidfds in `poller`, so that its poll wakes at a death; returns
        pidfd -> rank, for lost_ranks."""
        local = self.local_pids()
        fds = self._exits.fds(local.values())
        exits = {fds[pid]: rank for rank, pid in local.items() if pid in fds}
        for fd in exits:
            poller.register(fd, zmq.POLLIN)
        return exits

    def lost_ranks(self, events: dict, exits: dict[int, int]) -> list[int]:
        """After a poll with watch_exits: the ranks whose pidfd fired (dead, whatever their pid is
        now) or whose process on this node is gone."""
        exited = {exits[fd] for fd in events if fd in exits}
        return sorted(exited.union(self.dead_ranks(list(range(self.config.tensor_parallel_size)))))

    def dead_ranks(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` whose process on this node is gone (remote ranks count as alive: only
        their silence tells)."""
        local = self.local_pids()
        return [rank for rank in ranks if rank in local and not process_alive(local[rank])]

    def await_result(self, step_id: int, started_s: float, deadline: float,
                     while_waiting: Callable[[float, float], None]) -> tuple[StepResult | None, list[int]]:
        """Rank 0's result once every rank has answered step_id, else (None, the silent ranks).
        If ranks answered with errors, the first error to arrive instead: a rank that raises makes the
        others fail later, at their collective's timeout (half --step-timeout), and a rank that
        hangs makes them fail while it never answers (a lost step names it). while_waiting(seconds the step
        has run, seconds its local ranks have been idle: RankProgress) is called every poll slice;
        a step idle past --stall-timeout is logged."""
        num_ranks, stall_s = self.config.tensor_parallel_size, self.config.stall_timeout_s
        progress = RankProgress(self.local_pids(), started_s)
        answers: dict[int, StepResult] = {}
        poller = zmq.Poller()
        poller.register(self._results, zmq.POLLIN)
        exits = self.watch_exits(poller)
        dead: list[int] = []
        stalled = False
        first_error: StepResult | None = None  # by arrival: the others' may be collective timeouts it caused
        while len(answers) < num_ranks and not self._should_exit():
            now = time.monotonic()
            remaining_s = deadline - now
            if remaining_s <= 0:
                break
            idle_s = progress.idle_s(now)
            if idle_s >= stall_s and not stalled:
                stalled = True
                self._log_stall(step_id, [rank for rank in range(num_ranks) if rank not in answers],
                                now - started_s, idle_s)
            while_waiting(now - started_s, idle_s)
            events = dict(poller.poll(int(min(remaining_s, POLL_SLICE_S) * 1000)))
            if self._results not in events:  # a slice passed, or a local rank exited
                # Any rank gone, even one that answered (with its collective's error), lost the group.
                dead = self.lost_ranks(events, exits)
                if dead:
                    break
                continue
            # Only StepResult is expected now: a WorkerReady here is counted as a protocol error.
            result = self._reader.decode(self._results.recv(), StepResult)
            if result is None:
                continue
            if result.step_id == step_id and result.rank < num_ranks:
                answers[result.rank] = result
                first_error = first_error or (result if result.error else None)
            else:
                self._reader.count_bad(f"discarded a result for step {result.step_id} from rank {result.rank} "
                                       f"while waiting for {step_id}")
        if len(answers) < num_ranks:
            return None, [rank for rank in range(num_ranks) if rank not in answers or rank in dead]
        if stalled:
            logger.warning("step %d took %.1f s; /health no longer reports a stall", step_id,
                           time.monotonic() - started_s)
        return first_error or answers[0], []

    def _log_stall(self, step_id: int, silent: list[int], running_s: float, idle_s: float) -> None:
        """Once per step idle past --stall-timeout: /health now says 'stalled' (the heartbeats
        carry the step's idle time), and an operator can see which ranks are late before the
        timeout."""
        logger.warning("step %d: worker %s not answered for %.0f s, and this node's ranks have used no "
                       "CPU for %.0f s (--stall-timeout): /health reports a stall; the group is replaced "
                       "at --step-timeout (%g s)", step_id,
                       f"{ranks_text(silent)} {'have' if len(silent) > 1 else 'has'}", running_s, idle_s,
                       self.config.step_timeout_s)


def ranks_text(ranks: list[int]) -> str:
    """'rank 1' or 'ranks 0, 2'."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
