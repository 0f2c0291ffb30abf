"""proto.transport: the deployment's key pair on disk, and CURVE step channels that admit only its holders."""

from __future__ import annotations

import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from support import free_port_block

from proto import codec, sockets, transport
from proto.config import EngineConfig
from proto.errors import ValidationError
from proto.messages import WorkerReady

READY = WorkerReady(rank=1, num_kv_blocks=9, pid=42)


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("keys") / "deployment"
    transport.write_key_pair(directory)
    return directory


def two_nodes(keys_dir: Path) -> EngineConfig:
    master_port = free_port_block(4)  # torch.distributed, results, plan-0, plan-1
    return EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=master_port,
                        transport_keys_dir=str(keys_dir))


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_keygen_writes_a_private_secret_file_and_a_public_one_and_never_overwrites(keys_dir: Path) -> None:
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((keys_dir / transport.SECRET_KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE((keys_dir / transport.PUBLIC_KEY_FILE).stat().st_mode) == 0o644
    keys = transport.load_transport_keys(keys_dir)
    assert zmq.curve_public(keys.secret_key) == keys.public_key
    assert keys.secret_key.decode() not in repr(keys)
    with pytest.raises(ValidationError, match="already holds a key pair"):
        transport.write_key_pair(keys_dir)


def test_unreadable_or_broken_keys_are_refused_saying_how_to_make_them(tmp_path: Path, keys_dir: Path) -> None:
    with pytest.raises(ValidationError, match="cannot read .*conveyor keygen DIR"):
        transport.load_transport_keys(tmp_path / "missing")
    (tmp_path / transport.SECRET_KEY_FILE).write_text('curve\n    public-key = "short"\n')
    with pytest.raises(ValidationError, match="does not hold a CURVE key pair"):
        transport.load_transport_keys(tmp_path)
    other_public, _ = zmq.curve_keypair()
    secret = (keys_dir / transport.SECRET_KEY_FILE).read_text()
    public = transport.load_transport_keys(keys_dir).public_key.decode()
    (tmp_path / transport.SECRET_KEY_FILE).write_text(secret.replace(public, other_public.decode()))
    with pytest.raises(ValidationError, match="the public key is not the secret key's"):
        transport.load_transport_keys(tmp_path)


def test_multi_node_without_keys_refuses_naming_both_flags() -> None:
    with pytest.raises(ValidationError, match="--transport-keys DIR.*conveyor keygen DIR.*--insecure-transport"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="10.0.0.1")
    with pytest.raises(ValidationError, match="contradict"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="10.0.0.1", transport_keys_dir="/k",
                     insecure_transport=True)
    assert not sockets.uses_curve(EngineConfig(transport_keys_dir="/k"))  # one node: ipc only


def test_a_key_holder_gets_through_a_curve_step_channel(keys_dir: Path, context: zmq.Context) -> None:
    config = two_nodes(keys_dir)
    guard = sockets.guard_step_channels(context, config)
    try:
        reader = sockets.bind_channel(context, zmq.PULL, config, sockets.RESULTS, guard)
        writer = sockets.connect_channel(context, zmq.PUSH, config, sockets.RESULTS)
        sockets.send(writer, READY)
        assert codec.decode(sockets.recv_ready(reader, 5.0), type(READY)) == READY
        assert guard.num_refused == 0
    finally:
        guard.stop()


def test_peers_without_the_key_get_no_frame_in_and_no_plan_out(keys_dir: Path, context: zmq.Context) -> None:
    config = two_nodes(keys_dir)
    guard = sockets.guard_step_channels(context, config)
    try:
        results = sockets.bind_channel(context, zmq.PULL, config, sockets.RESULTS, guard)
        plans = sockets.bind_channel(context, zmq.PUSH, config, sockets.plan_channel(0), guard)
        intruders = [_intruder(context, config, sockets.RESULTS, zmq.PUSH, curve) for curve in (False, True)]
        for intruder in intruders:
            intruder.send(codec.encode(READY))
        thief = _intruder(context, config, sockets.plan_channel(0), zmq.PULL, curve=True)
        deadline = time.monotonic() + 5.0
        while guard.num_refused < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert guard.num_refused == 2  # the CURVE intruder and thief, refused by the ZAP handler
        worker = sockets.connect_channel(context, zmq.PULL, config, sockets.plan_channel(0))
        for _ in range(4):  # PUSH deals round-robin: a thief that got in would take some
            assert plans.poll(5000, zmq.POLLOUT)
            plans.send(codec.encode(READY), zmq.NOBLOCK)
        assert [sockets.recv_ready(worker, 5.0) for _ in range(4)] == [codec.encode(READY)] * 4
        assert sockets.recv_ready(thief, 0.1) is None
        assert sockets.recv_ready(results, 1.0) is None  # the reader never sees an intruder's frame
    finally:
        guard.stop()


def test_a_curve_server_socket_cannot_be_bound_without_its_zap_handler(keys_dir: Path,
                                                                        context: zmq.Context) -> None:
    with pytest.raises(ValueError, match="start guard_step_channels"):
        sockets.bind_channel(context, zmq.PULL, two_nodes(keys_dir), sockets.RESULTS)


def _intruder(context: zmq.Context, config: EngineConfig, channel: str, kind: int, curve: bool) -> zmq.Socket:
    """A peer that knows the address (and, with curve, the server's public key) but not the secret."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = transport.load_transport_keys(config.transport_keys_dir).public_key
    sock.connect(sockets.channel_address(config, channel, for_bind=False))
    return sock
