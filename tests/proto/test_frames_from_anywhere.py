"""proto, decode side of every reader: a frame that is no valid message of the channel raises
ProtocolError and nothing else; forged length prefixes allocate nothing; oversized frames are cut
off at the socket."""

from __future__ import annotations

import shutil
import tracemalloc

import msgpack
import pytest
import zmq
from garbage_frames import any_frames, huge_prefix_frames
from hypothesis import given, settings

from proto import codec, messages, sockets
from proto.config import EngineConfig
from proto.errors import ProtocolError
from proto.messages import StepPlan, WorkerReady

READERS = {
    "scheduler requests": sockets.REQUEST_MESSAGES,
    "scheduler results": sockets.RESULT_MESSAGES,
    "worker plans": sockets.PLAN_MESSAGES,
    "frontend outputs": sockets.OUTPUT_MESSAGES,
    "supervisor control": sockets.CONTROL_MESSAGES,
}


@pytest.mark.parametrize("reader", READERS)
def test_a_reader_gets_a_valid_message_of_its_channel_or_a_protocol_error_and_nothing_else(
        reader: str) -> None:
    expected = READERS[reader]

    @settings(max_examples=300, deadline=None)
    @given(frame=any_frames())
    def check(frame: bytes) -> None:
        try:
            message = codec.decode(frame, expected)
        except ProtocolError:
            return
        assert isinstance(message, expected)
        again = codec.decode(codec.encode(message), expected)  # what passed is a well-formed message
        assert codec.encode(again) == codec.encode(message)

    check()


@settings(max_examples=50, deadline=None)
@given(frame=huge_prefix_frames)
def test_a_forged_huge_length_prefix_is_refused_without_allocating_it(frame: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError):
            codec.decode(frame, messages.MESSAGE_TYPES)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 1 << 20


def test_nesting_deeper_than_msgpack_allows_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        codec.decode(b"\x91" * 100_000 + b"\x00", messages.MESSAGE_TYPES)


def test_a_message_of_another_channel_is_a_protocol_error_that_names_both() -> None:
    frame = codec.encode(WorkerReady(0, 8, 1))
    with pytest.raises(ProtocolError, match="WorkerReady does not belong on this channel.*StepPlan"):
        codec.decode(frame, StepPlan)


def test_a_reader_drops_a_frame_over_its_size_cap_and_still_takes_the_next() -> None:
    runtime_dir = sockets.make_runtime_dir()
    context = zmq.Context()
    try:
        reader = sockets.bind(context, zmq.PULL, runtime_dir, sockets.RESULTS, max_frame_bytes=1024)
        writer = sockets.connect(context, zmq.PUSH, runtime_dir, sockets.RESULTS)
        writer.send(msgpack.packb([4, 0, 1, 2]) + b"\x00" * 4096)  # disconnects the writer
        assert sockets.recv_ready(reader, 0.5) is None
        writer.close()
        writer = sockets.connect(context, zmq.PUSH, runtime_dir, sockets.RESULTS)
        sockets.send(writer, WorkerReady(0, 8, 1))
        assert codec.decode(sockets.recv_ready(reader, 5.0), WorkerReady) == WorkerReady(0, 8, 1)
    finally:
        context.destroy(linger=0)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_the_frame_cap_leaves_room_for_the_largest_real_plan() -> None:
    config = EngineConfig(max_num_seqs=256, max_model_len=131072, max_num_batched_tokens=8192)
    history_and_block_tables = config.max_num_seqs * config.max_model_len * (4 + 4 / config.block_size)
    assert history_and_block_tables < sockets.max_frame_bytes(config) < 1 << 30
