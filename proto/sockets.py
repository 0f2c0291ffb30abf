"""ZeroMQ channel names, addresses and socket helpers shared by every process loop."""

from __future__ import annotations

import ipaddress
import os
import tempfile
import time

import zmq

from proto import codec, transport
from proto.config import EngineConfig
from proto.control import GroupLost, ProcessFailed, ProcessReady, RestartScheduler, RestartWorkers, StartGroup
from proto.messages import (AbortRequest, AddRequest, FrontendHello, StepOutputs, StepPlan, StepResult,
                            WorkerReady)

REQUESTS = "requests"  # frontend -> scheduler (PUSH/PULL)
OUTPUTS = "outputs"  # scheduler -> frontend (PUSH/PULL)
RESULTS = "results"  # workers -> scheduler (PUSH/PULL)
CONTROL = "control"  # children -> supervisor (PUSH/PULL)
GROUP = "group"  # node 0's supervisor <-> the other nodes' (ROUTER/DEALER, tcp:// only)

# What a reader accepts on each channel (codec.decode's `expected`); anything else is a protocol error.
REQUEST_MESSAGES = (AddRequest, AbortRequest, FrontendHello)
OUTPUT_MESSAGES = (StepOutputs,)
RESULT_MESSAGES = (WorkerReady, StepResult)
PLAN_MESSAGES = (StepPlan,)
CONTROL_MESSAGES = (ProcessReady, ProcessFailed, RestartWorkers, RestartScheduler)
GROUP_TO_NODE0_MESSAGES = (GroupLost,)
GROUP_FROM_NODE0_MESSAGES = (StartGroup,)

MIN_MAX_FRAME_BYTES = 64 << 20
# Channels whose queue ZeroMQ must not cap (its default high-water mark is 1000 frames a side):
# what bounds the requests channel is admission (max_num_waiting, max_waiting_tokens), and a
# frontend resubmitting every open request to a replacement scheduler may send thousands at once.
UNCAPPED_CHANNELS = (REQUESTS,)


def plan_channel(rank: int) -> str:
    """scheduler -> worker rank (one PUSH/PULL pair per rank: nothing is dropped for late joiners)."""
    return f"plan-{rank}"


def is_step_channel(channel: str) -> bool:
    """The scheduler <-> worker channels and the supervisors' group channel: the ones that cross nodes."""
    return channel in (RESULTS, GROUP) or channel.startswith("plan-")


def tcp_port(master_port: int, channel: str, tensor_parallel_size: int = 0) -> int:
    """results on master_port + 1, plan-R on master_port + 2 + R, the supervisors' group channel
    after the last plan port, on master_port + 2 + tensor_parallel_size (master_port is
    torch.distributed's)."""
    if channel == RESULTS:
        return master_port + 1
    if channel.startswith("plan-"):
        return master_port + 2 + int(channel[len("plan-"):])
    if channel == GROUP and tensor_parallel_size > 0:
        return master_port + 2 + tensor_parallel_size
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
    return f"tcp://{host}:{tcp_port(config.master_port, channel, config.tensor_parallel_size)}"


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def max_frame_bytes(config: EngineConfig) -> int:
    """ZMQ_MAXMSGSIZE of every reading socket: a peer whose frame claims more is disconnected
    before anything is allocated for it. Far above any real frame (a plan carries at most
    max_model_len history tokens and block ids per member and a few hundred bytes per scheduled
    token in logprobs), far below what a forged length prefix could ask for."""
    per_member_bytes = 16 * config.max_model_len
    return (MIN_MAX_FRAME_BYTES + config.max_num_seqs * per_member_bytes
            + 1024 * config.max_num_batched_tokens)


def uses_curve(config: EngineConfig) -> bool:
    """The tcp:// step channels of a multi-node deployment with --transport-keys."""
    return config.nnodes > 1 and bool(config.transport_keys_dir)


def guard_step_channels(context: zmq.Context, config: EngineConfig) -> transport.KeyGuard | None:
    """The ZAP handler the binding side starts before bind_channel when the channels use CURVE."""
    if not uses_curve(config):
        return None
    return transport.KeyGuard(context, transport.load_transport_keys(config.transport_keys_dir))


def make_runtime_dir() -> str:
    """A fresh private (0700) directory for ipc:// socket files."""
    path = tempfile.mkdtemp(prefix="conveyor-")
    os.chmod(path, 0o700)
    return path


def address(runtime_dir: str, channel: str) -> str:
    if runtime_dir.startswith("tcp://"):
        raise ValueError("tcp channels are addressed per host, not by runtime_dir")
    return f"ipc://{os.path.join(runtime_dir, channel)}.sock"


def bind(context: zmq.Context, kind: int, runtime_dir: str, channel: str,
         max_frame_bytes: int = -1) -> zmq.Socket:
    """max_frame_bytes (readers: max_frame_bytes(config)) caps inbound frames; -1 = no cap."""
    sock = _new_socket(context, kind, max_frame_bytes, uncapped=channel in UNCAPPED_CHANNELS)
    sock.bind(address(runtime_dir, channel))
    return sock


def connect(context: zmq.Context, kind: int, runtime_dir: str, channel: str,
            max_frame_bytes: int = -1) -> zmq.Socket:
    sock = _new_socket(context, kind, max_frame_bytes, uncapped=channel in UNCAPPED_CHANNELS)
    sock.connect(address(runtime_dir, channel))
    return sock


def bind_channel(context: zmq.Context, kind: int, config: EngineConfig, channel: str,
                 guard: transport.KeyGuard | None = None, max_frame_bytes: int = -1) -> zmq.Socket:
    """Like bind, but a step channel goes over TCP when the ranks span nodes, as a CURVE server
    when uses_curve(config) (then `guard`, from guard_step_channels, must be running)."""
    endpoint = channel_address(config, channel, for_bind=True)
    sock = _new_socket(context, kind, max_frame_bytes, endpoint)
    if endpoint.startswith("tcp://") and uses_curve(config):
        if guard is None:
            sock.close(linger=0)
            raise ValueError(f"{channel} uses CURVE: start guard_step_channels before binding it")
        transport.make_curve_server(sock, guard.keys)
    _bind_retrying(sock, endpoint)
    return sock


def _bind_retrying(sock: zmq.Socket, endpoint: str, timeout_s: float = 5.0) -> None:
    """A socket just closed on the same TCP port (the scheduler reopening its step channels for a
    new worker group) releases the port on libzmq's I/O thread a moment later: retry until then."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or not endpoint.startswith("tcp://") or time.monotonic() > deadline:
                sock.close(linger=0)
                raise
            time.sleep(0.02)


def connect_channel(context: zmq.Context, kind: int, config: EngineConfig, channel: str,
                    max_frame_bytes: int = -1, routing_id: bytes = b"") -> zmq.Socket:
    """Like connect; over TCP as a CURVE client with the deployment's keys when uses_curve(config).
    routing_id: how a ROUTER peer addresses this socket (set before connecting)."""
    endpoint = channel_address(config, channel, for_bind=False)
    sock = _new_socket(context, kind, max_frame_bytes, endpoint)
    if routing_id:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if endpoint.startswith("tcp://") and uses_curve(config):
        try:
            transport.make_curve_client(sock, transport.load_transport_keys(config.transport_keys_dir))
        except BaseException:
            sock.close(linger=0)
            raise
    sock.connect(endpoint)
    return sock


def _new_socket(context: zmq.Context, kind: int, max_frame_bytes: int, endpoint: str = "",
                uncapped: bool = False) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if uncapped:
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def send(sock: zmq.Socket, message: object) -> None:
    sock.send(codec.encode(message), copy=False)


def recv_ready(sock: zmq.Socket, timeout_s: float) -> bytes | None:
    """Block up to timeout_s for one frame; None on timeout (never busy-waits)."""
    if sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return sock.recv(copy=True)
    return None
