"""The frontend's OUTPUTS reader takes frames from anywhere: each frame that is no StepOutputs is
counted and reported to listeners, is no sign of life, and the next valid outputs are routed."""

from __future__ import annotations

import numpy as np
from garbage_frames import rejected_frames
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.engine_client import ZmqEngineClient
from proto import codec, sockets
from proto.messages import SchedulerStats, StepOutputs


class Recorder:
    def __init__(self) -> None:
        self.num_outputs, self.num_protocol_errors = 0, 0

    def on_step_outputs(self, outputs: StepOutputs) -> None:
        self.num_outputs += 1

    def on_protocol_error(self) -> None:
        self.num_protocol_errors += 1


HEARTBEAT = StepOutputs(-1, [], np.zeros(1, np.int32), np.zeros(0, np.int32), [], [],
                        SchedulerStats(0, 0, 0, 0.0, 0), 0.0, 1.0)


@settings(max_examples=150, deadline=None)
@given(noise=st.lists(rejected_frames(sockets.OUTPUT_MESSAGES), min_size=1, max_size=5))
def test_garbage_outputs_frames_are_counted_are_no_sign_of_life_and_the_next_outputs_route(
        noise: list[bytes]) -> None:
    client, recorder = ZmqEngineClient("/nonexistent"), Recorder()
    client.add_listener(recorder)
    for frame in noise:
        client.handle_frame(frame)
    assert client.num_protocol_errors == recorder.num_protocol_errors == len(noise)
    assert not client.is_alive() and recorder.num_outputs == 0
    client.handle_frame(codec.encode(HEARTBEAT))
    assert client.is_alive() and recorder.num_outputs == 1
    assert client.latest_stats is not None and client.latest_stats == HEARTBEAT.stats
