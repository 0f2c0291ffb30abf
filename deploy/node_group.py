"""The supervisors' group channel across nodes. Node 0's supervisor alone picks worker generations
(one per worker group it starts) and tells every other node's supervisor to start the same one
(StartGroup); the others never start a group on their own: when one of their ranks dies they stop
their ranks and report it (GroupLost), and wait. One picker means the nodes cannot disagree on the
group: at worst a node misses a StartGroup, and node 0 repeats the current one every second.
"""

from __future__ import annotations

import logging
import time

import zmq

from proto import codec, sockets, transport
from proto.config import EngineConfig
from proto.errors import ProtocolError
from proto.control import GroupLost, StartGroup

log = logging.getLogger("conveyor.deploy")

ANNOUNCE_INTERVAL_S = 1.0  # node 0 repeats the current generation, for nodes that missed it
# Another node that has heard node 0 and then hears nothing for this long takes node 0's supervisor
# for gone (its ranks cannot serve without node 0's scheduler) and stops, rather than wait forever.
NODE0_SILENCE_S = 15.0


def node_id(node_rank: int) -> bytes:
    return f"node{node_rank}".encode()


class GroupChannel:
    """Node 0: a ROUTER bound on the group port (a CURVE server with --transport-keys); node r > 0:
    a DEALER connected to it, addressed as node_id(r)."""

    def __init__(self, context: zmq.Context, config: EngineConfig) -> None:
        self.node_rank, self.nnodes = config.node_rank, config.nnodes
        self.num_protocol_errors = 0
        self._guard: transport.KeyGuard | None = None
        self._current = StartGroup(config.worker_generation, "start-up")
        self._announced_s = 0.0
        self._heard_s: float | None = None  # node r > 0: time.monotonic() of node 0's last message
        if config.node_rank == 0:
            self._guard = sockets.guard_step_channels(context, config)  # ZAP before the bind
            self._sock = sockets.bind_channel(context, zmq.ROUTER, config, sockets.GROUP, self._guard,
                                              sockets.max_frame_bytes(config))
        else:
            self._sock = sockets.connect_channel(context, zmq.DEALER, config, sockets.GROUP,
                                                 sockets.max_frame_bytes(config), node_id(config.node_rank))

    def announce(self, generation: int, cause: str) -> None:
        """Node 0: every other node starts group `generation` (now, and again each second)."""
        self._current = StartGroup(generation, cause)
        self._announced_s = 0.0
        self.poll_announce()

    def poll_announce(self) -> None:
        if self.node_rank != 0 or time.monotonic() - self._announced_s < ANNOUNCE_INTERVAL_S:
            return
        frame = codec.encode(self._current)
        for node_rank in range(1, self.nnodes):
            try:  # an unconnected node is skipped (ROUTER drops); the next announcement reaches it
                self._sock.send_multipart([node_id(node_rank), frame], zmq.NOBLOCK)
            except zmq.Again:
                pass
        self._announced_s = time.monotonic()

    def report_lost(self, generation: int, cause: str) -> None:
        """Node r > 0: a rank of group `generation` died here; DEALER queues it until connected."""
        sockets.send(self._sock, GroupLost(self.node_rank, generation, cause))

    def receive(self) -> GroupLost | StartGroup | None:
        """The next message without waiting (GroupLost on node 0, StartGroup elsewhere), or None.
        A malformed frame, or one of the wrong kind, is logged, counted and skipped."""
        while True:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            expected = sockets.GROUP_TO_NODE0_MESSAGES if self.node_rank == 0 else sockets.GROUP_FROM_NODE0_MESSAGES
            try:
                message = codec.decode(parts[-1], expected)
            except ProtocolError as exc:
                self.num_protocol_errors += 1
                log.warning("ignoring a malformed group frame (%d so far): %s", self.num_protocol_errors, exc)
                continue
            if self.node_rank != 0:
                self._heard_s = time.monotonic()
            return message

    def node0_silence(self, now_s: float | None = None) -> str:
        """Node r > 0: why to stop when node 0 has been heard and then silent past NODE0_SILENCE_S
        (it repeats the group every ANNOUNCE_INTERVAL_S), else ''. Never before node 0 is first heard:
        node 0 may start after this node."""
        if self.node_rank == 0 or self._heard_s is None:
            return ""
        silent_s = (time.monotonic() if now_s is None else now_s) - self._heard_s
        if silent_s <= NODE0_SILENCE_S:
            return ""
        return (f"node 0's supervisor has been silent for {silent_s:.0f} s (it repeats the worker group "
                f"every {ANNOUNCE_INTERVAL_S:.0f} s): it is gone, so this node's ranks cannot serve")

    @property
    def socket(self) -> zmq.Socket:
        """For the supervisor's wait: readable when a message has arrived."""
        return self._sock

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
