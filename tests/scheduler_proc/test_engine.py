"""Engine contract: step ids, plan contents, seeds, stats and step-less outputs."""

from __future__ import annotations

import numpy as np
import pytest

from proto import codec
from proto.messages import StepResult
from scheduler_fakes import Harness
from scheduler_proc.engine import StepMismatchError


def test_a_result_for_another_step_raises_and_changes_nothing() -> None:
    harness = Harness()
    harness.add("a", 4, max_tokens=3)
    plan = harness.engine.schedule()
    with pytest.raises(StepMismatchError, match=f"step {plan.step_id + 1}"):
        harness.engine.apply_result(StepResult(plan.step_id + 1, np.array([5], np.int32), ""))
    harness.engine.check_invariants()
    harness.log.record(harness.engine.apply_result(harness.worker(plan)))
    assert harness.log.tokens["a"] and harness.engine.in_flight_step_id is None


def test_a_result_with_no_step_in_flight_raises() -> None:
    harness = Harness()
    with pytest.raises(StepMismatchError, match="no step"):
        harness.engine.apply_result(StepResult(0, np.empty(0, np.int32), ""))


def test_scheduling_again_before_the_result_arrives_is_refused() -> None:
    harness = Harness()
    harness.add("a", 4)
    harness.engine.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        harness.engine.schedule()


def test_plan_arrays_are_consistent_and_survive_the_codec() -> None:
    harness = Harness(max_num_batched_tokens=12)
    harness.add("plain", 5, max_tokens=4, temperature=0.7, top_k=-1, top_p=0.9, seed=1234)
    harness.add("penalised", 6, max_tokens=4, repetition_penalty=1.3, frequency_penalty=0.5, top_k=20)
    harness.add("chunked", 20, max_tokens=2, logit_bias=((7, -3.0),))
    harness.step()
    plan = harness.step()
    decoded = codec.decode(codec.encode(plan), type(plan))
    for name, value in vars(plan).items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(getattr(decoded, name), value, err_msg=name)
    assert plan.request_ids == ["plain", "penalised", "chunked"]
    assert plan.num_scheduled_tokens.tolist() == [1, 1, 10]
    # chunked waited in step 1 (a chunk of 1 would be a lone query); now plain's first block is cached
    assert plan.num_computed_tokens.tolist() == [5, 6, 4]
    assert plan.sample_mask.tolist() == [True, True, False]
    assert plan.sampling.top_k.tolist() == [0, 20, 0]
    assert plan.sampling.seeds[0] == 1234
    chunked = harness.engine.get_request("chunked")
    np.testing.assert_array_equal(plan.input_ids[2:], chunked.token_ids[4:14])
    # Penalty history only for the penalised member, which samples this step.
    assert np.diff(plan.sampling.history.cu).tolist() == [0, 7, 0]
    assert plan.sampling.history.num_prompt.tolist() == [0, 6, 0]
    # chunked does not sample this step, so its logit_bias is not sent.
    assert plan.sampling.bias.rows.tolist() == []
    for row, request_id in enumerate(plan.request_ids):
        table = plan.block_ids[plan.cu_block_ids[row]:plan.cu_block_ids[row + 1]]
        np.testing.assert_array_equal(table, harness.engine.get_request(request_id).block_ids)


def test_a_drawn_seed_is_63_bits_and_survives_preemption() -> None:
    harness = Harness(num_blocks=6, max_num_seqs=4)
    for request_id in ("a", "b", "c"):
        harness.add(request_id, 8, max_tokens=6)
    seed_c = harness.engine.get_request("c").seed
    assert 0 <= seed_c < 2**63
    plans = harness.run()
    assert harness.engine.stats().num_preemptions_total > 0
    seeds_of_c = {int(p.sampling.seeds[p.request_ids.index("c")]) for p in plans if "c" in p.request_ids}
    assert seeds_of_c == {seed_c}


def test_step_outputs_carry_stats() -> None:
    harness = Harness(num_blocks=10, max_num_seqs=1)
    harness.add("a", 8, max_tokens=3)
    harness.add("b", 4, max_tokens=3)
    harness.step()
    outputs = harness.log.messages[-1]
    assert (outputs.stats.num_running, outputs.stats.num_waiting) == (1, 1)
    assert outputs.stats.kv_cache_usage == pytest.approx(0.2)
    assert outputs.step_duration_s >= 0 and outputs.wall_time_s > 1.6e9
    assert outputs.step_id == 0 and outputs.num_scheduled_tokens == 8


def test_heartbeat_has_step_id_minus_one_and_current_stats() -> None:
    harness = Harness()
    harness.add("a", 4)
    beat = harness.engine.heartbeat()
    assert beat.step_id == -1 and beat.num_outputs == 0 and beat.stats.num_waiting == 1


def test_drain_outputs_is_none_when_there_is_nothing_to_report() -> None:
    harness = Harness()
    assert harness.engine.drain_outputs() is None


def test_a_request_aborted_while_its_step_runs_gets_no_output_after_the_abort() -> None:
    harness = Harness()
    harness.add("a", 4, max_tokens=5)
    harness.add("b", 4, max_tokens=5)
    plan = harness.engine.schedule()
    harness.engine.abort(["a"])
    harness.log.record(harness.engine.apply_result(harness.worker(plan)))
    harness.engine.check_invariants()
    harness.run()
    assert harness.log.finish_reasons == {"a": "abort", "b": "length"}
    assert harness.log.tokens["a"] == []
