"""Every finish reason, and exactly one terminal output per request."""

from __future__ import annotations

import numpy as np

from proto.messages import ERROR_CODES, AddRequest
from proto.sampling import SamplingParams
from scheduler_fakes import FILLER_TOKEN, Harness

EOS = 2


def test_eos_stops_with_reason_stop_and_the_eos_token_is_reported() -> None:
    harness = Harness(scripts={"a": [11, 12, EOS, 13]})
    harness.add("a", 4, max_tokens=10)
    harness.run()
    assert harness.log.finish_reasons["a"] == "stop"
    assert harness.log.tokens["a"] == [11, 12, EOS]


def test_stop_token_ids_stop_with_reason_stop() -> None:
    harness = Harness(scripts={"a": [11, 42, 13]})
    harness.add("a", 4, max_tokens=10, stop_token_ids=(42,))
    harness.run()
    assert (harness.log.finish_reasons["a"], harness.log.tokens["a"]) == ("stop", [11, 42])


def test_ignore_eos_keeps_generating_past_eos_until_max_tokens() -> None:
    harness = Harness(scripts={"a": [EOS, EOS, 11]})
    harness.add("a", 4, max_tokens=3, ignore_eos=True)
    harness.run()
    assert (harness.log.finish_reasons["a"], harness.log.tokens["a"]) == ("length", [EOS, EOS, 11])


def test_min_tokens_masks_stop_tokens_in_the_plan_until_enough_tokens_exist() -> None:
    harness = Harness(scripts={"a": [EOS, 42, EOS, EOS]})
    harness.add("a", 4, max_tokens=10, min_tokens=2, stop_token_ids=(42,), logit_bias=((42, 5.0), (7, 1.0)))
    harness.run()
    # The worker obeys the -inf triples: outputs 1 and 2 become the filler, output 3 is EOS.
    assert harness.log.tokens["a"] == [FILLER_TOKEN, FILLER_TOKEN, EOS]
    assert harness.log.finish_reasons["a"] == "stop"
    first, _, third = harness.worker.plans
    masked = dict(zip(first.sampling.bias.token_ids.tolist(), first.sampling.bias.values.tolist()))
    assert masked == {42: float("-inf"), EOS: float("-inf"), 7: 1.0}
    assert dict(zip(third.sampling.bias.token_ids.tolist(), third.sampling.bias.values.tolist())) == {42: 5.0, 7: 1.0}


def test_a_stop_token_the_worker_failed_to_mask_does_not_stop_before_min_tokens() -> None:
    harness = Harness(scripts={"a": [EOS, EOS, EOS]})
    harness.add("a", 4, max_tokens=10, min_tokens=1, ignore_eos=True, stop_token_ids=(EOS,))
    harness.worker.obeys_bias = False
    harness.run()
    assert harness.log.tokens["a"] == [EOS, EOS]


def test_a_duplicate_request_id_is_rejected_without_touching_the_live_request() -> None:
    harness = Harness()
    harness.add("a", 4, max_tokens=3)
    harness.step()
    harness.engine.add(AddRequest("a", np.arange(4, dtype=np.int32), SamplingParams(max_tokens=3), 0.0))
    rejection = harness.engine.drain_outputs()
    assert rejection.finish_reasons == ["error"] and "already in use" in rejection.error_messages[0]
    assert len(rejection.events.kinds) == 0  # the id's lifecycle events belong to the live request
    harness.run()
    assert len(harness.log.tokens["a"]) == 3


def test_max_tokens_finishes_with_reason_length() -> None:
    harness = Harness()
    harness.add("a", 4, max_tokens=3)
    harness.run()
    assert harness.log.finish_reasons["a"] == "length" and len(harness.log.tokens["a"]) == 3


def test_max_model_len_finishes_with_reason_length() -> None:
    harness = Harness(max_model_len=10)
    harness.add("a", 7, max_tokens=50)
    harness.add("full", 9, max_tokens=50)  # the longest prompt that fits gets exactly one token
    harness.run()
    assert harness.log.finish_reasons == {"a": "length", "full": "length"}
    assert len(harness.log.tokens["a"]) == 3 and len(harness.log.tokens["full"]) == 1


def test_aborting_a_waiting_request_finishes_it_with_reason_abort() -> None:
    harness = Harness(max_num_seqs=1)
    harness.add("a", 4, max_tokens=5)
    harness.add("b", 4, max_tokens=5)
    harness.step()
    harness.abort("b")
    harness.run()
    assert harness.log.finish_reasons == {"a": "length", "b": "abort"}
    assert harness.log.tokens["b"] == []


def test_aborting_a_running_request_frees_its_blocks_at_once() -> None:
    harness = Harness(num_blocks=16)
    harness.add("a", 9, max_tokens=5)
    harness.step()
    harness.abort("a", "unknown-id")
    assert harness.engine.block_manager.num_free_blocks == 16
    assert harness.step() is None
    assert harness.log.finish_reasons == {"a": "abort"}
    assert len(harness.log.tokens["a"]) == 1


def test_an_abort_after_the_final_output_is_ignored() -> None:
    harness = Harness()
    harness.add("a", 4, max_tokens=1)
    harness.run()
    harness.abort("a")
    assert harness.engine.drain_outputs() is None


def test_prompt_longer_than_max_model_len_is_rejected_with_the_limit_and_the_value() -> None:
    harness = Harness(max_model_len=16)
    harness.add("a", 17, max_tokens=1)
    harness.run()
    assert harness.log.finish_reasons["a"] == "error"
    assert "17" in harness.log.error_messages["a"] and "16" in harness.log.error_messages["a"]


def test_prompt_of_exactly_max_model_len_is_rejected_as_the_frontend_rejects_it() -> None:
    harness = Harness(max_model_len=16)
    harness.add("a", 16, max_tokens=1)  # no room left for a generated token (proto.config.prompt_fits)
    harness.run()
    assert harness.log.finish_reasons["a"] == "error"
    assert "16 tokens but max_model_len is 16" in harness.log.error_messages["a"]


def test_request_that_can_never_fit_in_the_kv_cache_is_rejected_instead_of_waiting_forever() -> None:
    harness = Harness(num_blocks=4)  # 16 token slots
    harness.add("fits", 10, max_tokens=7)  # 16 slots: the last sampled token is never fed
    harness.add("too-big", 10, max_tokens=8)
    harness.run()
    assert harness.log.finish_reasons == {"fits": "length", "too-big": "error"}
    assert "4 blocks" in harness.log.error_messages["too-big"]
    assert "17 tokens" in harness.log.error_messages["too-big"]


def test_a_worker_error_fails_the_step_requests_with_its_message() -> None:
    harness = Harness(max_num_seqs=1)
    harness.add("a", 4, max_tokens=5)
    harness.add("b", 4, max_tokens=5)
    harness.step()
    harness.worker.fail_next_step = "CUDA out of memory"
    harness.step()
    assert harness.log.finish_reasons == {"a": "error"}
    assert "CUDA out of memory" in harness.log.error_messages["a"]
    harness.run()
    assert harness.log.finish_reasons == {"a": "error", "b": "length"}


def test_a_result_with_the_wrong_number_of_tokens_fails_the_step_not_the_engine() -> None:
    harness = Harness()
    harness.add("a", 4, max_tokens=5)
    plan = harness.engine.schedule()
    result = harness.worker(plan)
    bad = type(result)(result.step_id, np.concatenate([result.sampled_token_ids, [5]]).astype(np.int32), "")
    harness.log.record(harness.engine.apply_result(bad))
    harness.engine.check_invariants()
    assert harness.log.finish_reasons == {"a": "error"}
    assert "2 sampled tokens for 1" in harness.log.error_messages["a"]


def test_a_full_waiting_queue_rejects_the_new_request_and_names_the_limit() -> None:
    harness = Harness(max_num_seqs=1, max_num_waiting=2)
    for request_id in ("a", "b", "c", "d"):  # the free seat takes one, the queue two more
        harness.add(request_id, 4, max_tokens=2)
    outputs = harness.engine.drain_outputs()
    assert outputs.request_ids == ["d"] and outputs.finish_reasons == ["error"]
    assert "max_num_waiting is 2 (beyond 1 free seat)" in outputs.error_messages[0]
    harness.log.record(outputs)
    harness.run()
    assert harness.log.finish_reasons == {"a": "length", "b": "length", "c": "length", "d": "error"}


def test_a_burst_to_an_idle_engine_fills_its_seats_and_then_its_queue() -> None:
    harness = Harness(max_num_seqs=4, max_num_waiting=2)
    for index in range(7):
        harness.add(f"r{index}", 4, max_tokens=2)
    outputs = harness.engine.drain_outputs()
    assert outputs.request_ids == ["r6"] and "beyond 4 free seats" in outputs.error_messages[0]
    harness.log.record(outputs)
    harness.step()  # four run: their seats are no longer free, the queue holds two
    harness.add("late", 4, max_tokens=2)
    late = harness.engine.drain_outputs()
    assert late.request_ids == ["late"] and "beyond 0 free seats" in late.error_messages[0]
    harness.log.record(late)
    harness.run()
    assert harness.log.finish_reasons == {**{f"r{i}": "length" for i in range(6)}, "r6": "error", "late": "error"}


def test_each_choice_of_a_request_counts_against_the_waiting_queue_bound_unless_it_is_empty() -> None:
    harness = Harness(max_num_seqs=1, max_num_waiting=3)
    harness.add("a", 4, max_tokens=2)
    harness.add("four", 4, max_tokens=2, n=4)  # 1 + 4 sequences would pass 3 + the free seat
    harness.add("two", 4, max_tokens=2, n=2)
    outputs = harness.engine.drain_outputs()
    assert outputs.request_ids == ["four"] * 4 and "this request adds 4" in outputs.error_messages[0]
    harness.log.record(outputs)
    harness.run()
    harness.add("five", 4, max_tokens=2, n=5)  # an empty queue takes it
    harness.run()
    assert harness.log.finish_reasons == {"a": "length", **{f"four{s}": "error" for s in ("", "#1", "#2", "#3")},
                                          "two": "length", "two#1": "length", **{
                                              key: "length" for key in ("five", "five#1", "five#2", "five#3", "five#4")}}


def test_a_full_queue_rejection_carries_the_queue_full_code_and_one_that_never_runs_invalid_request() -> None:
    harness = Harness(max_num_seqs=1, max_num_waiting=1, max_model_len=16)
    harness.add("too-long", 17, max_tokens=1)
    harness.add("a", 4, max_tokens=2)
    harness.add("full", 4, max_tokens=2, n=2)
    outputs = harness.engine.drain_outputs()
    assert outputs.request_ids == ["too-long", "full", "full"]
    assert outputs.finish_reasons == ["error"] * 3
    assert [ERROR_CODES[code] for code in outputs.error_codes] == ["invalid_request", "queue_full", "queue_full"]
    harness.log.record(outputs)
    harness.run()
    assert harness.log.finish_reasons == {"too-long": "error", "a": "length", "full": "error",
                                          "full#1": "error"}


def test_shutdown_gives_every_unfinished_request_a_terminal_output() -> None:
    harness = Harness(max_num_seqs=1)
    harness.add("a", 4, max_tokens=5)
    harness.add("b", 4, max_tokens=5)
    harness.step()
    harness.log.record(harness.engine.finish_all("shutting down"))
    harness.engine.check_invariants()
    assert harness.log.finish_reasons == {"a": "error", "b": "error"}
    assert harness.engine.block_manager.num_free_blocks == 64


def test_a_running_static_batch_opens_no_seat_to_the_queue() -> None:
    harness = Harness(max_num_seqs=4, max_num_waiting=1, scheduling="static")
    harness.add("a", 4, max_tokens=5)
    harness.step()  # a static batch of one runs: its three empty seats wait for the batch's end
    harness.add("b", 4, max_tokens=2)
    harness.add("c", 4, max_tokens=2)
    outputs = harness.engine.drain_outputs()
    assert outputs.request_ids == ["c"] and "beyond 0 free seats" in outputs.error_messages[0]
    harness.log.record(outputs)
    harness.run()
    assert harness.log.finish_reasons == {"a": "length", "b": "length", "c": "error"}
