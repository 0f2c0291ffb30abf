"""ZeroMQ channel names, addresses and socket helpers shared by every process loop."""

from __future__ import annotations

import os
import tempfile

import zmq

from proto import codec

REQUESTS = "requests"  # frontend -> scheduler (PUSH/PULL)
OUTPUTS = "outputs"  # scheduler -> frontend (PUSH/PULL)
RESULTS = "results"  # workers -> scheduler (PUSH/PULL)
CONTROL = "control"  # children -> supervisor (PUSH/PULL)


def plan_channel(rank: int) -> str:
    """scheduler -> worker rank (one PUSH/PULL pair per rank: nothing is dropped for late joiners)."""
    return f"plan-{rank}"


def make_runtime_dir() -> str:
    """A fresh private (0700) directory for ipc:// socket files."""
    path = tempfile.mkdtemp(prefix="conveyor-")
    os.chmod(path, 0o700)
    return path


def address(runtime_dir: str, channel: str) -> str:
    if runtime_dir.startswith("tcp://"):
        raise ValueError("tcp channels are addressed per host, not by runtime_dir")
    return f"ipc://{os.path.join(runtime_dir, channel)}.sock"


def bind(context: zmq.Context, kind: int, runtime_dir: str, channel: str) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address(runtime_dir, channel))
    return sock


def connect(context: zmq.Context, kind: int, runtime_dir: str, channel: str) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address(runtime_dir, channel))
    return sock


def send(sock: zmq.Socket, message: object) -> None:
    sock.send(codec.encode(message), copy=False)


def recv_ready(sock: zmq.Socket, timeout_s: float) -> bytes | None:
    """Block up to timeout_s for one frame; None on timeout (never busy-waits)."""
    if sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return sock.recv(copy=True)
    return None
