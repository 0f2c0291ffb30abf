"""A request resubmitted to a replaced scheduler (AddRequest.resume) continues where the lost one's
outputs stopped: its resumed output tokens count for max_tokens, min_tokens, penalties and the stop
rule, finished choices do not run again, prompt logprobs are not sent twice, and the continued
outputs equal an undisturbed run's."""

from __future__ import annotations

import time

import numpy as np
import pytest

from proto import codec
from proto.errors import ProtocolError
from proto.messages import ERROR_NONE, AddRequest, ResumedOutputs
from proto.sampling import SamplingParams
from scheduler_fakes import FakeWorker, Harness, choice_key
from scheduler_proc.stop import active_bias


def resume_of(tokens: list[list[int]], finished: list[bool], num_prompt_logprobs: int = 0) -> ResumedOutputs:
    cu = np.concatenate(([0], np.cumsum([len(t) for t in tokens]))).astype(np.int32)
    flat = np.asarray([t for choice in tokens for t in choice], dtype=np.int32)
    return ResumedOutputs(cu, flat, np.asarray(finished, dtype=np.bool_), num_prompt_logprobs)


def add_resumed(harness: Harness, request_id: str, prompt: list[int], resume: ResumedOutputs,
                **params: object) -> None:
    params.setdefault("temperature", 0.0)
    message = AddRequest(request_id, np.asarray(prompt, dtype=np.int32), SamplingParams(**params), time.time(),
                         resume=resume)
    message = codec.decode(codec.encode(message), AddRequest)  # as the scheduler reads it
    for index in range(int(params.get("n", 1))):
        start, end = int(resume.cu_token_ids[index]), int(resume.cu_token_ids[index + 1])
        harness.worker.expect(choice_key(request_id, index), prompt + resume.token_ids[start:end].tolist())
        harness.worker.prompt_lengths[choice_key(request_id, index)] = len(prompt)
    harness.engine.add(message)
    harness.engine.check_invariants()


PROMPT = list(range(100, 110))


def workload(harness: Harness) -> None:
    harness.add("a", PROMPT, max_tokens=12)
    harness.add("b", PROMPT[:5], max_tokens=9, prompt_logprobs=2, logprobs=1)
    harness.add("c", 30, max_tokens=10, n=3, temperature=0.8, seed=5)
    harness.add("d", 40, max_tokens=6, min_tokens=4, repetition_penalty=1.3)
    harness.add("e", 9, max_tokens=14, ignore_eos=True)


@pytest.mark.parametrize("lost_after", [0, 1, 2, 4, 7, 11])
def test_a_replaced_scheduler_continues_every_request_to_an_undisturbed_runs_outputs(lost_after: int) -> None:
    config = dict(max_num_seqs=4, max_num_batched_tokens=32)
    undisturbed = Harness(num_blocks=24, **config)
    workload(undisturbed)
    undisturbed.run()

    lost = Harness(num_blocks=24, **config)
    workload(lost)
    for _ in range(lost_after):
        lost.step()
    received = lost.log  # what the frontend got before the scheduler died
    new = Harness(num_blocks=24, **config)
    requests = {"a": (PROMPT, dict(max_tokens=12), 1), "b": (PROMPT[:5], dict(max_tokens=9, prompt_logprobs=2,
                                                                                 logprobs=1), 1),
                "c": ((100 + np.arange(30) % 800).tolist(), dict(max_tokens=10, n=3, temperature=0.8, seed=5), 3),
                "d": ((100 + np.arange(40) % 800).tolist(), dict(max_tokens=6, min_tokens=4,
                                                                 repetition_penalty=1.3), 1),
                "e": ((100 + np.arange(9) % 800).tolist(), dict(max_tokens=14, ignore_eos=True), 1)}
    for request_id, (prompt, params, n) in requests.items():
        keys = [choice_key(request_id, index) for index in range(n)]
        finished = [key in received.finish_reasons for key in keys]
        if all(finished):
            continue
        prompt_positions = [p for p, *_ in received.logprobs.get(request_id, []) if p < len(prompt)]
        resume = resume_of([received.tokens.get(key, []) for key in keys], finished,
                           max(prompt_positions) + 1 if prompt_positions else 0)
        add_resumed(new, request_id, prompt, resume, **params)
    new.run()
    for key, reason in undisturbed.log.finish_reasons.items():
        assert received.tokens.get(key, []) + new.log.tokens.get(key, []) == undisturbed.log.tokens[key], key
        assert received.finish_reasons.get(key, new.log.finish_reasons.get(key)) == reason, key
        assert not (key in received.finish_reasons and key in new.log.finish_reasons), f"{key} ran again"
    combined = received.logprobs.get("b", []) + new.log.logprobs.get("b", [])
    assert combined == undisturbed.log.logprobs["b"]  # no prompt or token logprob twice, none missing


def test_resumed_tokens_count_for_max_tokens_min_tokens_and_the_history() -> None:
    harness = Harness()
    add_resumed(harness, "r", PROMPT, resume_of([[11, 12, 13]], [False]), max_tokens=5, min_tokens=4,
                repetition_penalty=1.2)
    request = harness.engine.get_request("r")
    assert request.num_output_tokens == 3 and request.num_tokens == len(PROMPT) + 3
    assert request.token_ids[-3:].tolist() == [11, 12, 13] and request.last_token_id == 13
    assert active_bias(request) is request.min_tokens_logit_bias  # the 4th output may not stop yet
    assert not request.prompt_logprobs_pending
    plan = harness.step()
    assert plan.num_scheduled_tokens.tolist() == [len(PROMPT) + 3]  # prompt + output recomputed, then it samples
    assert plan.sampling.history.token_ids.tolist()[-3:] == [11, 12, 13]  # penalties see the resumed output
    harness.run()
    assert len(harness.log.tokens["r"]) == 2 and harness.log.finish_reasons["r"] == "length"  # 3 + 2 = max_tokens


def test_a_resumed_stop_token_before_min_tokens_does_not_end_it_but_a_new_one_after_does() -> None:
    harness = Harness(scripts={"r": [0, 0, 0, 2]})  # the worker samples EOS (2) as output number 4
    add_resumed(harness, "r", PROMPT, resume_of([[2, 7, 8]], [False]), max_tokens=10, min_tokens=2)
    harness.run()
    assert harness.log.tokens["r"] == [2] and harness.log.finish_reasons["r"] == "stop"


def test_finished_choices_are_not_run_again_and_the_first_unfinished_one_leads() -> None:
    harness = Harness()
    add_resumed(harness, "n", PROMPT, resume_of([[21, 22], [31], [41, 42, 43]], [True, False, False]),
                max_tokens=6, n=3, temperature=0.7, seed=3)
    assert harness.engine.get_request("n", 0) is None
    leader, sibling = harness.engine.get_request("n", 1), harness.engine.get_request("n", 2)
    assert leader.leader is None and sibling.leader is leader and leader.held_siblings == [sibling]
    harness.run()
    assert set(harness.log.finish_reasons) == {"n#1", "n#2"}
    assert len(harness.log.tokens["n#1"]) == 5 and len(harness.log.tokens["n#2"]) == 3


def test_a_resubmission_is_not_refused_by_the_queue_limits() -> None:
    harness = Harness(max_num_waiting=1)
    harness.add("waiting", 5, max_tokens=3)
    add_resumed(harness, "r", PROMPT, resume_of([[11]], [False]), max_tokens=3)
    assert harness.engine.get_request("r") is not None
    harness.run()
    assert harness.log.finish_reasons == {"waiting": "length", "r": "length"}


def test_a_resume_that_could_not_have_happened_is_refused_with_the_reason() -> None:
    harness = Harness()
    add_resumed(harness, "big", PROMPT, resume_of([[5000]], [False]), max_tokens=3)
    refused = harness.engine.drain_outputs()
    assert refused.error_codes.tolist() in ([], [ERROR_NONE])  # uncoded: the server's error, not a 400
    harness.log.record(refused)
    harness.run()
    assert harness.log.finish_reasons["big"] == "error" and "out of range" in harness.log.error_messages["big"]
    harness = Harness(max_model_len=12)
    add_resumed(harness, "long", PROMPT, resume_of([[11, 12]], [False]), max_tokens=8)
    harness.run()
    assert harness.log.finish_reasons["long"] == "error" and "max_model_len" in harness.log.error_messages["long"]


@pytest.mark.parametrize("resume, match", [
    (resume_of([[1, 2]], [False, False]), "finished needs 1"),
    (resume_of([[1, 2, 3]], [False]), "would have finished"),
    (resume_of([[1]], [True]), "no unfinished choice"),
    (ResumedOutputs(np.array([0, 3], np.int32), np.array([1, 2], np.int32), np.array([False])), "run from 0 to 2"),
])
def test_a_malformed_resume_is_a_protocol_error(resume: ResumedOutputs, match: str) -> None:
    message = AddRequest("x", np.asarray(PROMPT, np.int32), SamplingParams(max_tokens=3), 0.0, resume=resume)
    with pytest.raises(ProtocolError, match=match):
        codec.decode(codec.encode(message), AddRequest)


def test_the_fake_worker_checks_the_resumed_kv() -> None:
    """The harness's worker reads back every resumed sequence's cache: a resume it did not expect fails."""
    harness = Harness()
    add_resumed(harness, "r", PROMPT, resume_of([[11, 12]], [False]), max_tokens=6)
    harness.worker = FakeWorker(64, harness.config.block_size)
    harness.worker.expect("r", PROMPT + [11, 99])
    with pytest.raises(AssertionError, match="corrupted"):
        harness.run()


def test_prompt_logprobs_forwarded_before_the_loss_are_not_sent_again() -> None:
    prompt = (100 + np.arange(40)).tolist()  # prefilled in chunks of 16: the loss comes mid-prompt
    undisturbed = Harness(max_num_batched_tokens=16)
    undisturbed.add("p", prompt, max_tokens=3, prompt_logprobs=1)
    undisturbed.run()
    lost = Harness(max_num_batched_tokens=16)
    lost.add("p", prompt, max_tokens=3, prompt_logprobs=1)
    lost.step()
    received = lost.log.logprobs["p"]
    assert received and not lost.log.tokens.get("p")  # lost mid-prompt: logprobs came, no token
    new = Harness(max_num_batched_tokens=16)
    add_resumed(new, "p", prompt, resume_of([[]], [False], max(p for p, *_ in received) + 1),
                max_tokens=3, prompt_logprobs=1)
    new.run()
    assert received + new.log.logprobs["p"] == undisturbed.log.logprobs["p"]
    assert lost.log.tokens.get("p", []) + new.log.tokens["p"] == undisturbed.log.tokens["p"]
