"""Logprobs plumbing: what the plan asks of the worker, and how its entries reach the outputs."""

from __future__ import annotations

import numpy as np

from proto.logprobs import LogprobEntries
from proto.messages import StepResult
from scheduler_fakes import Harness, fake_logprob

PROMPT = list(range(300, 310))


def test_the_plan_asks_for_logprobs_per_member_and_names_the_next_prompt_token() -> None:
    harness = Harness(max_num_batched_tokens=8)
    harness.add("sampled", 3, max_tokens=3, logprobs=3)
    harness.add("prompt", PROMPT, max_tokens=2, prompt_logprobs=2)
    harness.add("plain", 3, max_tokens=3)
    plan = harness.step()
    assert plan.request_ids == ["sampled", "prompt"]
    assert plan.sampling.logprobs.tolist() == [3, -1]
    assert plan.sampling.num_prompt_logprobs.tolist() == [-1, 2]
    assert plan.sampling.next_prompt_token_ids.tolist() == [-1, PROMPT[5]]  # its chunk is positions 0..4
    plan = harness.step()  # plain's 3 would get 2 of the budget, leaving a lone token: it waits
    assert plan.request_ids == ["sampled", "prompt"]
    assert plan.sampling.num_prompt_logprobs.tolist() == [-1, 2]
    assert plan.sampling.next_prompt_token_ids.tolist() == [-1, -1]  # the chunk ends the prompt
    harness.run()
    assert all((p.sampling.num_prompt_logprobs == -1).all() for p in harness.worker.plans[2:])  # prompt done


def test_sampled_token_logprobs_reach_the_outputs_at_their_positions() -> None:
    harness = Harness()
    harness.add("a", 5, max_tokens=4, logprobs=2)
    harness.add("b", 4, max_tokens=3)
    harness.run()
    entries = harness.log.logprobs["a"]
    tokens = harness.log.tokens["a"]
    assert [(p, t) for p, t, _, _ in entries] == [(5 + k, token) for k, token in enumerate(tokens)]
    assert all(lp == fake_logprob(t, p) and top == [t + 1, t + 2] for p, t, lp, top in entries)
    assert "b" not in harness.log.logprobs


def test_prompt_logprobs_cover_every_prompt_position_once_across_chunks() -> None:
    harness = Harness(max_num_batched_tokens=3)
    harness.add("a", PROMPT, max_tokens=2, prompt_logprobs=1, logprobs=0)
    harness.run()
    entries = harness.log.logprobs["a"]
    prompt_entries = [(p, t) for p, t, _, _ in entries if p < len(PROMPT)]
    assert prompt_entries == [(p, PROMPT[p]) for p in range(1, len(PROMPT))]
    assert [len(top) for _, _, _, top in entries] == [1] * 9 + [0, 0]
    assert harness.log.messages[0].logprobs.rows.tolist() == [0, 0, 0]  # a chunk without a token still has a row


def test_a_request_owing_prompt_logprobs_computes_its_whole_prompt_despite_the_cache() -> None:
    harness = Harness()
    harness.add("warm", PROMPT, max_tokens=2)
    harness.run()
    harness.add("scored", PROMPT, max_tokens=2, prompt_logprobs=0)
    plan = harness.step()
    assert (int(plan.num_computed_tokens[0]), int(plan.num_scheduled_tokens[0])) == (0, len(PROMPT))
    harness.run()
    assert harness.log.num_cached_tokens["scored"] == 0
    assert [p for p, _, _, _ in harness.log.logprobs["scored"]] == list(range(1, len(PROMPT)))


def test_only_choice_0_owes_prompt_logprobs() -> None:
    harness = Harness()
    harness.add("a", PROMPT, max_tokens=2, n=3, prompt_logprobs=0)
    harness.run()
    assert [p for p, _, _, _ in harness.log.logprobs["a"]] == list(range(1, len(PROMPT)))
    assert "a#1" not in harness.log.logprobs and "a#2" not in harness.log.logprobs


def test_prompt_entries_recomputed_after_a_preemption_are_forwarded_once() -> None:
    # Budget 4 and 4 blocks of 4: "a" (8-token prompt) decodes and grows; "b" (12-token prompt,
    # prompt logprobs) is preempted part-way through its prompt and recomputes it from 0.
    harness = Harness(num_blocks=4, max_num_batched_tokens=4, max_num_seqs=2)
    harness.add("a", 3, max_tokens=10)
    harness.step()
    harness.add("b", PROMPT + [310, 311], max_tokens=1, prompt_logprobs=0)
    harness.run()
    assert harness.engine.stats().num_preemptions_total >= 1
    positions = [p for p, _, _, _ in harness.log.logprobs["b"]]
    assert positions == list(range(1, 12))
    assert harness.log.ranks["b"] == [p % 5 + 1 for p in positions]  # each entry's rank came with it


def test_entries_for_members_outside_the_batch_fail_the_step() -> None:
    harness = Harness()
    harness.add("a", 4, max_tokens=3, logprobs=1)
    plan = harness.engine.schedule()
    result = harness.worker(plan)
    bad = StepResult(result.step_id, result.sampled_token_ids, "", LogprobEntries(
        rows=np.array([3], np.int32), positions=np.array([4], np.int32), token_ids=np.array([1], np.int32),
        logprobs=np.zeros(1, np.float32), ranks=np.ones(1, np.int32), cu_top=np.zeros(2, np.int32)))
    harness.log.record(harness.engine.apply_result(bad))
    harness.engine.check_invariants()
    assert harness.log.finish_reasons == {"a": "error"}
    assert "members 3..3 of 1" in harness.log.error_messages["a"]
