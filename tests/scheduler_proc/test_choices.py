"""n > 1: sibling choices with derived seeds, sharing the prompt's blocks, each ending exactly once."""

from __future__ import annotations

import random

import pytest

from scheduler_fakes import Harness
from scheduler_proc.choices import choice_seed


def rows_of(plan, request_id: str, n: int) -> dict[int, int]:
    """choice index -> plan row, for the choices of request_id in `plan`."""
    labels = [request_id] + [f"{request_id}#{i}" for i in range(1, n)]
    return {i: plan.request_ids.index(label) for i, label in enumerate(labels) if label in plan.request_ids}


def test_every_choice_ends_exactly_once_with_its_own_tokens() -> None:
    harness = Harness()
    harness.add("a", 6, max_tokens=4, n=3)
    harness.add("b", 5, max_tokens=2)
    harness.run()
    assert harness.log.finish_reasons == {"a": "length", "a#1": "length", "a#2": "length", "b": "length"}
    assert all(len(harness.log.tokens[key]) == 4 for key in ("a", "a#1", "a#2"))
    assert len({tuple(harness.log.tokens[key]) for key in ("a", "a#1", "a#2")}) == 3


def test_choice_seeds_are_derived_from_the_request_seed_and_reproducible() -> None:
    def seeds(seed: int | None, rng_seed: int) -> list[int]:
        harness = Harness()
        harness.engine._rng = random.Random(rng_seed)
        harness.add("a", 6, max_tokens=2, n=4, seed=seed, temperature=0.8)
        plan = harness.step()
        harness.run()
        plans = [plan] + [p for p in harness.worker.plans if len(rows_of(p, "a", 4)) == 3]
        by_choice = {}
        for p in plans:
            for choice, row in rows_of(p, "a", 4).items():
                by_choice.setdefault(choice, set()).add(int(p.sampling.seeds[row]))
        assert all(len(values) == 1 for values in by_choice.values())
        return [by_choice[i].pop() for i in range(4)]

    seeded = seeds(1234, rng_seed=0)
    assert seeded == [1234] + [choice_seed(1234, i) for i in range(1, 4)]
    assert len(set(seeded)) == 4 and all(0 <= s < 2**63 for s in seeded[1:])
    assert seeds(1234, rng_seed=99) == seeded  # the client's seed decides, not the engine's draws
    unseeded = seeds(None, rng_seed=7)
    assert unseeded[1:] == [choice_seed(unseeded[0], i) for i in range(1, 4)]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_siblings_share_the_prompts_full_blocks_and_compute_only_its_last_partial_block(
        enable_prefix_caching: bool) -> None:
    harness = Harness(enable_prefix_caching=enable_prefix_caching)
    harness.add("a", 10, max_tokens=3, n=3)  # blocks of 4: two full prompt blocks, 2 tokens left
    first = harness.step()
    assert first.request_ids == ["a"]  # siblings are held until choice 0 has the prompt
    second = harness.step()
    rows = rows_of(second, "a", 3)
    assert [(int(second.num_computed_tokens[r]), int(second.num_scheduled_tokens[r])) for r in rows.values()] == [
        (10, 1), (8, 2), (8, 2)]
    tables = [second.block_ids[second.cu_block_ids[r]:second.cu_block_ids[r + 1]].tolist() for r in rows.values()]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({table[2] for table in tables}) == 3  # each choice writes its own partial block
    harness.run()
    expected_cached = 8 if enable_prefix_caching else 0
    assert harness.log.num_cached_tokens == {"a": 0, "a#1": expected_cached, "a#2": expected_cached}
    assert set(harness.log.finish_reasons.values()) == {"length"}


def test_aborting_a_request_aborts_every_choice_even_held_ones() -> None:
    harness = Harness()
    harness.add("held", 6, max_tokens=5, n=3)
    harness.add("running", 6, max_tokens=5, n=2)
    harness.step()
    harness.step()
    harness.abort("held")  # its siblings run already
    harness.add("fresh", 6, max_tokens=5, n=4)
    harness.abort("fresh")  # choice 0 waiting, three siblings held
    harness.run()
    reasons = harness.log.finish_reasons
    assert [reasons[k] for k in ("held", "held#1", "held#2", "fresh", "fresh#1", "fresh#2", "fresh#3")] == [
        "abort"] * 7
    assert reasons["running"] == reasons["running#1"] == "length"
    assert harness.engine.block_manager.usage == 0.0


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_aborting_one_choice_frees_its_blocks_at_once_while_its_sibling_runs_on(
        enable_prefix_caching: bool) -> None:
    harness = Harness(enable_prefix_caching=enable_prefix_caching)
    harness.add("a", 10, max_tokens=12, n=2)  # blocks of 4: two full prompt blocks are shared
    for _ in range(4):
        harness.step()
    stopped, sibling = harness.engine.get_request("a", 1), harness.engine.get_request("a", 0)
    tokens_before = list(harness.log.tokens["a#1"])
    own = [b for b in stopped.block_ids.tolist() if b not in sibling.block_ids.tolist()]
    shared = [b for b in stopped.block_ids.tolist() if b in sibling.block_ids.tolist()]
    assert tokens_before and own and shared
    harness.abort("a", choice_index=1)
    pool = harness.engine.block_manager.pool
    assert harness.engine.get_request("a", 1) is None and harness.engine.get_request("a", 0) is sibling
    assert [pool.ref_count(b) for b in own] == [0] * len(own)
    assert [pool.ref_count(b) for b in shared] == [1] * len(shared)  # choice 0 keeps the prompt
    assert harness.engine.stats().num_running == 1
    plans = harness.run()
    assert plans and all("a#1" not in plan.request_ids for plan in plans)
    assert harness.log.finish_reasons == {"a": "length", "a#1": "abort"}
    assert harness.log.tokens["a#1"] == tokens_before
    assert len(harness.log.tokens["a"]) == 12
    assert harness.engine.block_manager.usage == 0.0


def test_aborting_one_held_choice_drops_it_and_its_siblings_run_on() -> None:
    harness = Harness()
    harness.add("a", 6, max_tokens=3, n=3)
    harness.abort("a", choice_index=2)  # still held: choice 0 has not computed the prompt yet
    assert harness.engine.stats().num_waiting == 2
    harness.run()
    assert harness.log.finish_reasons == {"a": "length", "a#1": "length", "a#2": "abort"}
    assert harness.log.tokens["a#2"] == [] and len(harness.log.tokens["a#1"]) == 3


def test_aborting_choice_0_alone_mid_prompt_releases_its_held_siblings() -> None:
    harness = Harness(max_num_batched_tokens=4)  # the prompt takes three steps
    harness.add("a", 10, max_tokens=3, n=3)
    harness.step()
    harness.abort("a", choice_index=0)
    harness.run()
    assert harness.log.finish_reasons == {"a": "abort", "a#1": "length", "a#2": "length"}
    assert harness.engine.block_manager.usage == 0.0


def test_siblings_of_a_choice_0_that_stops_at_its_first_token_still_run() -> None:
    harness = Harness(scripts={"a": [2]})  # EOS at once
    harness.add("a", 6, max_tokens=3, n=3)
    harness.run()
    assert harness.log.finish_reasons == {"a": "stop", "a#1": "length", "a#2": "length"}
    assert len(harness.log.tokens["a#1"]) == 3


def test_held_siblings_count_as_waiting() -> None:
    harness = Harness()
    harness.add("a", 30, max_tokens=2, n=4)
    outputs = harness.engine.heartbeat()
    assert (outputs.stats.num_running, outputs.stats.num_waiting) == (0, 4)
