"""proto: placement config (nodes, ranks, devices), tcp step channels, and the fields they added."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import zmq
from support import free_port_block

from proto import codec, messages, sockets
from proto.config import EngineConfig
from proto.errors import ProtocolError, ValidationError
from proto.sampling import SamplingParams
from proto.sampling_columns import SamplingColumns

TWO_NODES = dict(tensor_parallel_size=4, nnodes=2, master_addr="10.0.0.5", master_port=4000,
                 insecure_transport=True)


def test_a_single_node_keeps_every_channel_on_ipc() -> None:
    config = EngineConfig(runtime_dir="/run/c", tensor_parallel_size=2)
    for channel in (sockets.RESULTS, sockets.plan_channel(1), sockets.REQUESTS, sockets.CONTROL):
        assert sockets.channel_address(config, channel, for_bind=True) == f"ipc:///run/c/{channel}.sock"


def test_across_nodes_the_step_channels_use_ports_after_the_master_port() -> None:
    config = EngineConfig(runtime_dir="/run/c", **TWO_NODES)
    assert sockets.channel_address(config, sockets.RESULTS, for_bind=False) == "tcp://10.0.0.5:4001"
    assert [sockets.channel_address(config, sockets.plan_channel(r), for_bind=True) for r in range(4)] == [
        "tcp://10.0.0.5:4002", "tcp://10.0.0.5:4003", "tcp://10.0.0.5:4004", "tcp://10.0.0.5:4005"]
    # frontend <-> scheduler and the control channel never leave node 0
    assert sockets.channel_address(config, sockets.OUTPUTS, for_bind=True).startswith("ipc://")


def test_a_master_host_name_is_bound_on_every_interface_and_connected_by_name() -> None:
    config = EngineConfig(**{**TWO_NODES, "master_addr": "leader.conveyor.svc"})
    assert sockets.channel_address(config, sockets.RESULTS, for_bind=True) == "tcp://*:4001"
    assert sockets.channel_address(config, sockets.RESULTS, for_bind=False) == \
        "tcp://leader.conveyor.svc:4001"
    ipv6 = EngineConfig(**{**TWO_NODES, "master_addr": "::1"})
    assert sockets.channel_address(ipv6, sockets.RESULTS, for_bind=True) == "tcp://[::1]:4001"


def test_a_frame_crosses_an_insecure_tcp_step_channel_on_loopback() -> None:
    master_port = free_port_block(4)  # torch.distributed, results, plan-0, plan-1
    config = EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                          master_port=master_port, insecure_transport=True)
    context = zmq.Context()
    try:
        reader = sockets.bind_channel(context, zmq.PULL, config, sockets.RESULTS)
        writer = sockets.connect_channel(context, zmq.PUSH, config, sockets.RESULTS)
        sent = messages.WorkerReady(rank=1, num_kv_blocks=9, pid=42)
        sockets.send(writer, sent)
        assert codec.decode(sockets.recv_ready(reader, 5.0), type(sent)) == sent
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("changes, message", [
    (dict(tensor_parallel_size=2, nnodes=2, insecure_transport=True), "needs master_addr"),
    (dict(tensor_parallel_size=3, nnodes=2, master_addr="h", insecure_transport=True),
     "must be a multiple of nnodes 2"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_addr="h", insecure_transport=True),
     r"node_rank must be in \[0, nnodes=2\)"),
    (dict(tensor_parallel_size=2, devices=(0,)), "lists 1 devices"),
    (dict(tensor_parallel_size=2, devices=(1, 1)), "distinct"),
    (dict(tensor_parallel_size=2, master_port=65534), "master_port must leave room"),
])
def test_bad_placement_is_refused_with_what_is_wrong(changes: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineConfig(**changes)


def test_each_node_starts_its_own_share_of_the_ranks() -> None:
    assert list(EngineConfig(**TWO_NODES).local_ranks) == [0, 1]
    assert list(EngineConfig(**TWO_NODES, node_rank=1).local_ranks) == [2, 3]
    config = EngineConfig(**TWO_NODES, devices=(3, 1))
    assert EngineConfig.from_json(config.to_json()) == config  # devices survive the JSON argv


def test_step_result_rank_and_the_prompt_look_ahead_round_trip_and_are_checked() -> None:
    result = messages.StepResult(3, np.zeros(0, np.int32), "", rank=2)
    assert codec.decode(codec.encode(result), messages.StepResult).rank == 2
    with pytest.raises(ProtocolError, match="rank must be >= 0"):
        codec.decode(codec.encode(dataclasses.replace(result, rank=-1)), messages.StepResult)
    sampling = dataclasses.replace(SamplingColumns.of_params([SamplingParams()]),
                                   num_prompt_logprobs=np.array([2], np.int32),
                                   next_prompt_token_ids=np.array([7], np.int32))
    plan = messages.StepPlan(
        step_id=1, request_ids=["a"], input_ids=np.array([5, 6], np.int32),
        num_computed_tokens=np.zeros(1, np.int32), num_scheduled_tokens=np.array([2], np.int32),
        cu_block_ids=np.array([0, 1], np.int32), block_ids=np.zeros(1, np.int32),
        sample_mask=np.zeros(1, bool), sampling=sampling)
    assert codec.decode(codec.encode(plan), messages.StepPlan).sampling.next_prompt_token_ids.tolist() == [7]
    bad = dataclasses.replace(sampling, next_prompt_token_ids=np.zeros(2, np.int32))
    with pytest.raises(ProtocolError, match="next_prompt_token_ids needs 0 or 1 entries"):
        codec.decode(codec.encode(dataclasses.replace(plan, sampling=bad)), messages.StepPlan)
