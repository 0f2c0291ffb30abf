"""The scheduler loop takes frames from anywhere on its real sockets: every frame that is no valid
message of the requests or results channel is counted once, and the next request is served."""

from __future__ import annotations

import itertools

from garbage_frames import rejected_frames
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loop_harness import running_loop

from proto import codec, sockets
from proto.control import ProcessReady

PROMPT_LEN = 3


def test_garbage_on_the_requests_and_results_sockets_is_counted_and_the_next_request_is_served() -> None:
    with running_loop() as (loop, frontend, control):
        assert isinstance(codec.decode(sockets.recv_ready(control, 5.0), sockets.CONTROL_MESSAGES), ProcessReady)
        request_numbers = itertools.count()

        @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(requests_noise=st.lists(rejected_frames(sockets.REQUEST_MESSAGES), max_size=4),
               results_noise=st.lists(rejected_frames(sockets.RESULT_MESSAGES), max_size=4))
        def check(requests_noise: list[bytes], results_noise: list[bytes]) -> None:
            before = loop.num_protocol_errors
            request_id = f"r{next(request_numbers)}"
            for frame in requests_noise:  # the same pipe as the request: all read before it
                frontend.requests.send(frame)
            frontend.worker.noise_before_next_result = list(results_noise)  # read before the result
            frontend.add(request_id, PROMPT_LEN, max_tokens=2)
            frontend.wait_finished(request_id)
            assert frontend.log.finish_reasons[request_id] == "length"
            assert frontend.log.tokens[request_id] == frontend.worker.fake.sequences[request_id][PROMPT_LEN:]
            assert loop.num_protocol_errors == before + len(requests_noise) + len(results_noise)

        check()
        assert frontend.log.messages[-1].stats.num_protocol_errors_total == loop.num_protocol_errors
    loop.engine.check_invariants()
