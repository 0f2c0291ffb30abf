"""The control plane's messages: every child -> its node's supervisor, and supervisor <-> supervisor.

Channels (proto.sockets names what each reader accepts):
  any child -> supervisor: ProcessReady, ProcessFailed, RestartWorkers (scheduler only),
                           RestartScheduler (frontend only)
  supervisor of node r > 0 <-> node 0's: GroupLost (to node 0), StartGroup (from node 0)
They travel through the same codec as every message (proto.messages.MESSAGE_TYPES tags them).
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.arrays import Int32Array


@dataclass(frozen=True)
class ProcessReady:
    name: str
    pid: int
    detail: str


@dataclass(frozen=True)
class ProcessFailed:
    name: str
    pid: int
    message: str


@dataclass(frozen=True)
class RestartWorkers:
    """Scheduler -> supervisor: these ranks are alive but lost a step (hung, or raised: `reason`
    says which); kill and replace the worker group. A rank that died needs no message: the
    supervisor sees its exit itself."""

    ranks: Int32Array  # [num_ranks]
    reason: str


@dataclass(frozen=True)
class RestartScheduler:
    """Frontend -> supervisor: the scheduler `pid` has sent nothing (no step, no heartbeat) for
    longer than the hang bound; kill and replace it (with its worker group). A scheduler that
    died needs no message: the supervisor sees its exit itself."""

    pid: int
    reason: str


@dataclass(frozen=True)
class GroupLost:
    """Supervisor of node `node_rank` > 0 -> node 0's supervisor: a rank of worker group
    `generation` died here (this node's ranks are stopped); replace the group on every node."""

    node_rank: int
    generation: int
    cause: str


@dataclass(frozen=True)
class StartGroup:
    """Node 0's supervisor -> every other node's: start worker group `generation` (stop the ranks of
    any older one first). Only node 0 picks generations, so the nodes never disagree on one."""

    generation: int
    cause: str
