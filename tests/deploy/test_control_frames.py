"""The supervisor's control reader takes frames from anywhere: a frame that is no ProcessReady or
ProcessFailed is logged, counted and ignored; the valid ones come through."""

from __future__ import annotations

from garbage_frames import rejected_frames
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.launcher import Stack
from proto import codec, sockets
from proto.config import EngineConfig
from proto.control import ProcessFailed, ProcessReady


@settings(max_examples=150, deadline=None)
@given(noise=st.lists(rejected_frames(sockets.CONTROL_MESSAGES), min_size=1, max_size=5))
def test_garbage_control_frames_are_counted_and_ignored_and_valid_ones_decode(noise: list[bytes]) -> None:
    stack = Stack(EngineConfig())  # not started: its control decoding alone
    assert [stack.decode_control(frame) for frame in noise] == [None] * len(noise)
    assert stack.num_protocol_errors == len(noise)
    for message in (ProcessReady("worker0", 1, "ok"), ProcessFailed("scheduler", 2, "boom")):
        assert stack.decode_control(codec.encode(message)) == message
    assert stack.num_protocol_errors == len(noise)
