"""Fair prefill: long prompts are capped per step so short requests are not starved behind them."""

from __future__ import annotations

from scheduler_fakes import Harness

LONG_PROMPT = 4096


def long_prompt_harness(**config: object) -> Harness:
    config = {"num_blocks": 1200, "block_size": 16, "max_model_len": 8192, "max_num_seqs": 16,
              "max_num_batched_tokens": 2048, **config}
    return Harness(**config)


def steps_until_first_token(harness: Harness, request_id: str) -> int:
    for steps in range(1, 100):
        harness.step()
        if harness.log.tokens.get(request_id):
            return steps
    raise AssertionError(f"{request_id} got no token in 100 steps")


def test_a_short_request_arriving_behind_a_4k_token_prompt_gets_its_first_token_within_2_steps() -> None:
    harness = long_prompt_harness(long_prefill_token_threshold=256)
    harness.add("long", LONG_PROMPT, max_tokens=4)
    harness.step()
    harness.add("short", 20, max_tokens=4)
    assert steps_until_first_token(harness, "short") <= 2
    harness.run()
    assert harness.log.finish_reasons == {"long": "length", "short": "length"}


def test_without_the_threshold_the_same_short_request_waits_for_the_whole_long_prefill() -> None:
    harness = long_prompt_harness(max_num_batched_tokens=512)
    harness.add("long", LONG_PROMPT, max_tokens=4)
    harness.step()
    harness.add("short", 20, max_tokens=4)
    assert steps_until_first_token(harness, "short") >= 7  # 4096 / 512 - 1 more steps of the long one


def test_a_long_prefill_gets_at_most_the_threshold_per_step() -> None:
    harness = long_prompt_harness(long_prefill_token_threshold=300)
    harness.add("long", 1000, max_tokens=2)
    plans = harness.run()
    assert [int(p.num_scheduled_tokens[0]) for p in plans] == [300, 300, 300, 100, 1]


def test_at_most_max_num_partial_prefills_long_prompts_share_a_step_and_short_ones_pass_them() -> None:
    harness = long_prompt_harness(long_prefill_token_threshold=128, max_num_partial_prefills=2)
    for index in range(3):
        harness.add(f"long{index}", 1024, max_tokens=2)
    harness.add("short", 30, max_tokens=2)
    plan = harness.step()
    assert plan.request_ids == ["long0", "long1", "short"]  # long2 is over the quota: short passes it
    assert plan.num_scheduled_tokens.tolist() == [128, 128, 30]
    for plan in harness.run():
        num_left = 1024 - plan.num_computed_tokens  # for the long members
        assert int(((plan.num_scheduled_tokens == 128) & (num_left > 128)).sum()) <= 2
    assert set(harness.log.finish_reasons.values()) == {"length"}
