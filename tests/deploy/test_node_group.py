"""deploy: the supervisors' group channel. Another node hears node 0's repeated worker group, and
once node 0 has been heard and then falls silent, that node gives up with the reason instead of
waiting forever."""

from __future__ import annotations

import time

import zmq
from support import free_port_block

from deploy.node_group import NODE0_SILENCE_S, GroupChannel
from proto.config import EngineConfig
from proto.control import StartGroup


def test_another_node_hears_node0s_group_and_names_node0_once_it_falls_silent() -> None:
    config = EngineConfig(model="m", tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                          master_port=free_port_block(5), insecure_transport=True)
    context = zmq.Context()
    node0 = GroupChannel(context, config.with_updates(node_rank=0))
    node1 = GroupChannel(context, config.with_updates(node_rank=1))
    try:
        assert node1.node0_silence() == ""  # node 0 not heard yet: it may start later
        node0.announce(3, "a rank was lost")
        deadline, message = time.monotonic() + 10, None
        while message is None and time.monotonic() < deadline:
            node0.announce(3, "a rank was lost")  # the first may go out before node 1 is connected
            time.sleep(0.05)
            message = node1.receive()
        assert message == StartGroup(3, "a rank was lost")
        heard_s = time.monotonic()
        assert node1.node0_silence(heard_s + NODE0_SILENCE_S / 2) == ""
        reason = node1.node0_silence(heard_s + NODE0_SILENCE_S + 5)
        assert "node 0's supervisor has been silent" in reason and "cannot serve" in reason
        assert node0.node0_silence(heard_s + 1e6) == ""  # node 0 itself never gives up on itself
    finally:
        node0.close()
        node1.close()
        context.term()
