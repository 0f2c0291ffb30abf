"""The waiting queue is bounded in prompt tokens (max_waiting_tokens) as well as in requests."""

from __future__ import annotations

from proto.messages import ERROR_CODES
from scheduler_fakes import Harness


def test_a_request_that_would_overfill_the_waiting_tokens_is_refused_with_its_own_code() -> None:
    harness = Harness(max_num_seqs=1, max_waiting_tokens=20)
    harness.add("running", 4, max_tokens=3)
    harness.step()  # "running" takes the only seat; the next ones wait
    harness.add("waits", 12, max_tokens=2)
    harness.add("fits", 8, max_tokens=2)  # 12 + 8 = 20: exactly the bound
    harness.add("refused", 1, max_tokens=2)
    outputs = harness.engine.drain_outputs()
    assert outputs.request_ids == ["refused"]
    assert [ERROR_CODES[code] for code in outputs.error_codes] == ["waiting_tokens_full"]
    assert "20 prompt tokens are waiting, this request adds 1 and max_waiting_tokens is 20" in (
        outputs.error_messages[0])
    assert harness.engine.stats().num_waiting_tokens == 20


def test_an_empty_queue_takes_a_prompt_longer_than_the_token_bound() -> None:
    harness = Harness(max_waiting_tokens=8)
    harness.add("long", 30, max_tokens=2)
    assert harness.engine.drain_outputs() is None
    harness.run()
    assert harness.log.finish_reasons == {"long": "length"}


def test_waiting_tokens_follow_admission_preemption_and_abort() -> None:
    harness = Harness(num_blocks=6, max_num_seqs=2)
    harness.add("a", 8, max_tokens=12)
    harness.add("b", 8, max_tokens=12)
    harness.add("c", 5, max_tokens=2)
    assert harness.engine.stats().num_waiting_tokens == 21
    harness.step()  # a and b admitted; c waits
    assert harness.engine.stats().num_waiting_tokens == 5
    harness.abort("c")
    assert harness.engine.stats().num_waiting_tokens == 0
    harness.run()  # 6 blocks of 4 cannot hold both to the end: one is preempted and requeued
    assert harness.engine.queues.num_preemptions_total > 0
    assert harness.engine.stats().num_waiting_tokens == 0

