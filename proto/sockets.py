"""ZeroMQ channel names, addresses and socket helpers shared by every process loop."""

from __future__ import annotations

import ipaddress
import os
import tempfile

import zmq

from proto import codec
from proto.config import EngineConfig

REQUESTS = "requests"  # frontend -> scheduler (PUSH/PULL)
OUTPUTS = "outputs"  # scheduler -> frontend (PUSH/PULL)
RESULTS = "results"  # workers -> scheduler (PUSH/PULL)
CONTROL = "control"  # children -> supervisor (PUSH/PULL)


def plan_channel(rank: int) -> str:
    """scheduler -> worker rank (one PUSH/PULL pair per rank: nothing is dropped for late joiners)."""
    return f"plan-{rank}"


def is_step_channel(channel: str) -> bool:
    """The scheduler <-> worker channels: the only ones that cross nodes."""
    return channel == RESULTS or channel.startswith("plan-")


def tcp_port(master_port: int, channel: str) -> int:
    """results on master_port + 1, plan-R on master_port + 2 + R (master_port is torch.distributed's)."""
    if channel == RESULTS:
        return master_port + 1
    if channel.startswith("plan-"):
        return master_port + 2 + int(channel[len("plan-"):])
    raise ValueError(f"channel {channel!r} never crosses nodes")


def channel_address(config: EngineConfig, channel: str, for_bind: bool) -> str:
    """ipc:// in the runtime dir, except the step channels of a multi-node deployment: tcp:// on
    the master address (bound there when it is an IP literal, on every interface for a name)."""
    if config.nnodes == 1 or not is_step_channel(channel):
        return address(config.runtime_dir, channel)
    host = config.master_addr
    if for_bind and not _is_ip_literal(host):
        host = "*"
    elif ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    return f"tcp://{host}:{tcp_port(config.master_port, channel)}"


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


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
    return _open(context, kind, address(runtime_dir, channel), for_bind=True)


def connect(context: zmq.Context, kind: int, runtime_dir: str, channel: str) -> zmq.Socket:
    return _open(context, kind, address(runtime_dir, channel), for_bind=False)


def bind_channel(context: zmq.Context, kind: int, config: EngineConfig, channel: str) -> zmq.Socket:
    """Like bind, but a step channel goes over TCP when the ranks span nodes."""
    return _open(context, kind, channel_address(config, channel, for_bind=True), for_bind=True)


def connect_channel(context: zmq.Context, kind: int, config: EngineConfig, channel: str) -> zmq.Socket:
    return _open(context, kind, channel_address(config, channel, for_bind=False), for_bind=False)


def _open(context: zmq.Context, kind: int, endpoint: str, for_bind: bool) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if for_bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def send(sock: zmq.Socket, message: object) -> None:
    sock.send(codec.encode(message), copy=False)


def recv_ready(sock: zmq.Socket, timeout_s: float) -> bytes | None:
    """Block up to timeout_s for one frame; None on timeout (never busy-waits)."""
    if sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return sock.recv(copy=True)
    return None
