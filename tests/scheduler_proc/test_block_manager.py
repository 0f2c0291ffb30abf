"""KV block accounting: allocation, freeing, the prefix cache (hash chain, sharing, LRU eviction)
and the invariant checker itself."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.sampling import SamplingParams
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.request import Request


def make_request(request_id: str, prompt: int | Sequence[int] = 4, **params: object) -> Request:
    """A running sequence; an int prompt means that many tokens 0, 1, 2, ..."""
    prompt_ids = np.arange(prompt) if isinstance(prompt, int) else np.asarray(prompt)
    request = Request(request_id, prompt_ids.astype(np.int32), SamplingParams(**params), seed=0)
    request.admit(admission_order=0)
    return request


def compute(manager: BlockManager, request: Request, num_tokens: int) -> None:
    """Admit-and-prefill `request` up to num_tokens as the policy and engine would."""
    if len(request.block_ids) == 0:
        prefix = manager.computed_prefix(request)
        assert manager.allocate(request, num_tokens, prefix)
        request.start(len(prefix) * manager.block_size, manager.record_lookup(request, len(prefix)))
    assert manager.allocate(request, num_tokens)
    request.advance(num_tokens - request.num_computed_tokens, token_id=-1)
    manager.cache_full_blocks(request)
    manager.check_invariants()


def test_allocate_covers_the_requested_tokens_in_whole_blocks() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    request = make_request("a")
    assert manager.allocate(request, 9)
    assert len(request.block_ids) == 3
    assert manager.allocate(request, 12)  # still fits in three blocks
    assert len(request.block_ids) == 3
    assert manager.allocate(request, 13)
    assert len(request.block_ids) == 4
    assert manager.num_free_blocks == 6
    assert manager.usage == pytest.approx(0.4)
    manager.check_invariants()


def test_allocation_is_all_or_nothing_when_blocks_run_out() -> None:
    manager = BlockManager(num_blocks=3, block_size=4)
    first, second = make_request("a"), make_request("b")
    assert manager.allocate(first, 8)
    assert not manager.allocate(second, 8)
    assert len(second.block_ids) == 0 and manager.num_free_blocks == 1
    manager.check_invariants()


def test_a_later_sequence_with_the_same_leading_tokens_shares_the_full_computed_blocks() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(10)))
    compute(manager, first, 10)  # blocks 0 and 1 are full; block 2 holds 2 tokens
    second = make_request("b", list(range(8)) + [50, 51, 52])
    prefix = manager.computed_prefix(second)
    assert prefix == first.block_ids[:2].tolist()
    compute(manager, second, 11)
    assert second.block_ids[:2].tolist() == prefix and second.block_ids[2] != first.block_ids[2]
    assert [manager.pool.ref_count(b) for b in prefix] == [2, 2]
    assert (manager.prefix_cache_queries_total, manager.prefix_cache_hits_total) == (21, 8)
    assert second.num_cached_tokens == 8 and first.num_cached_tokens == 0


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    compute(manager, make_request("a", 8), 8)
    again = make_request("b", 8)
    assert len(manager.computed_prefix(again)) == 1  # 7 of 8 tokens may come from the cache


def test_a_block_matches_only_after_the_same_parent_chain() -> None:
    manager = BlockManager(num_blocks=10, block_size=2)
    compute(manager, make_request("a", [1, 2, 7, 8, 0]), 5)
    assert manager.computed_prefix(make_request("b", [3, 4, 7, 8, 0])) == []  # same 2nd block, other parent
    assert len(manager.computed_prefix(make_request("c", [1, 2, 7, 9, 0]))) == 1  # 2nd block differs


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_freed_first_only_when_needed() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    old, new = make_request("old", [1, 2, 3, 4, 9]), make_request("new", [5, 6, 7, 8, 9])
    compute(manager, old, 5)
    compute(manager, new, 5)
    manager.free(old)
    manager.free(new)
    manager.check_invariants()
    assert manager.usage == 0.0 and manager.pool.num_cached == 4
    filler = make_request("filler", 8)
    assert manager.allocate(filler, 6)  # 2 uncached blocks, then old's tail block is evicted
    manager.check_invariants()
    assert manager.pool.num_evictions_total == 1
    assert len(manager.computed_prefix(make_request("x", [1, 2, 3, 4, 0, 0]))) == 1  # old's head survived
    assert len(manager.computed_prefix(make_request("y", [5, 6, 7, 8, 0, 0]))) == 2  # new is intact


def test_uncached_free_blocks_are_handed_out_before_any_cached_block_is_evicted() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    cached = make_request("a", [1, 2, 3])
    compute(manager, cached, 3)  # block 0 full and cached, block 1 partial
    manager.free(cached)
    other = make_request("b", 8)
    assert manager.allocate(other, 6)
    assert manager.pool.num_cached == 1 and manager.pool.num_evictions_total == 0
    manager.check_invariants()


def test_a_growing_sequence_takes_the_free_block_right_after_its_last_one() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    growing, neighbour = make_request("a", 8), make_request("b", [5, 6, 7, 8, 9])
    assert manager.allocate(growing, 4)  # blocks 0, 1
    compute(manager, neighbour, 5)  # blocks 2, 3 (both full and cached) and 4
    manager.free(neighbour)  # 4 is handed out first, then the cached 3 and 2
    assert manager.allocate(growing, 8)
    assert growing.block_ids.tolist() == [0, 1, 2, 3]  # one run: 2 and 3 were evicted for it
    assert manager.pool.num_evictions_total == 2 and manager.pool.num_cached == 0
    manager.check_invariants()


def test_blocks_taken_from_the_free_queue_come_in_ascending_order() -> None:
    manager = BlockManager(num_blocks=3, block_size=2)
    first = make_request("a", 7)
    compute(manager, first, 6)  # three full blocks, cached
    manager.free(first)  # released tail first: the queue holds 2, 1, 0
    second = make_request("b", 6)
    assert manager.allocate(second, 6)
    assert second.block_ids.tolist() == [0, 1, 2]  # the same run again, not reversed
    manager.check_invariants()


def test_a_request_owing_prompt_logprobs_never_reads_the_cache_but_publishes_its_blocks() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    compute(manager, make_request("a", 9), 9)
    scored = make_request("b", 9, prompt_logprobs=2)
    assert manager.computed_prefix(scored) == []
    compute(manager, scored, 9)
    assert manager.prefix_cache_queries_total == 9  # only a's lookup counted
    assert len(manager.computed_prefix(make_request("c", 10))) == 2


def test_without_prefix_caching_nothing_is_looked_up_or_published() -> None:
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    compute(manager, make_request("a", 9), 9)
    assert manager.computed_prefix(make_request("b", 9)) == [] and manager.pool.num_cached == 0
    assert manager.prefix_cache_queries_total == 0


def test_check_invariants_catches_a_block_held_twice_with_one_reference() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    first, second = make_request("a"), make_request("b")
    manager.allocate(first, 2)
    manager.allocate(second, 2)
    second.drop_blocks()  # behind the manager's back: its block keeps a reference, first's get none more
    second.add_blocks(first.block_ids)
    with pytest.raises(AssertionError, match="ref counts"):
        manager.check_invariants()


def test_check_invariants_catches_a_cached_block_under_another_prefix() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    request = make_request("a", [1, 2, 3])
    compute(manager, request, 3)
    request.block_keys[0] = (0, b"not these tokens")
    with pytest.raises(AssertionError, match="another prefix"):
        manager.check_invariants()


prompts = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=12)  # few symbols: many shared prefixes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12), prompts), max_size=50))
def test_any_sequence_of_admissions_computations_and_frees_keeps_the_invariants(
        ops: list[tuple[int, int, list[int]]]) -> None:
    manager = BlockManager(num_blocks=12, block_size=2)
    requests: dict[int, Request] = {}
    for index, num_tokens, prompt in ops:
        request = requests.get(index)
        if request is None or num_tokens == 0:  # (re)start a sequence with a new prompt
            if request is not None:
                manager.free(request)
            requests[index] = make_request(f"r{index}", prompt)
        elif len(request.block_ids) == 0:
            prefix = manager.computed_prefix(request)
            target = min(request.num_tokens, max(num_tokens, len(prefix) * 2 + 1))
            if manager.allocate(request, target, prefix):
                request.start(len(prefix) * 2, num_cache_hit_tokens=0)
                request.advance(target - request.num_computed_tokens, token_id=-1)
                manager.cache_full_blocks(request)
        elif manager.allocate(request, min(request.num_tokens, num_tokens)):
            target = min(request.num_tokens, num_tokens)
            request.advance(max(0, target - request.num_computed_tokens), token_id=-1)
            manager.cache_full_blocks(request)
        manager.check_invariants()
    for request in requests.values():
        manager.free(request)
    manager.check_invariants()
    assert manager.num_free_blocks == 12 and manager.usage == 0.0  # idle: every block free or cached


def test_a_cached_prefix_leaves_two_tokens_to_compute_where_the_prompt_has_two() -> None:
    """A lone last query would be attended as a decode, in other last bits than the whole prompt's
    block path: the cache then gives one block less (tokens 5-9 of 9 are computed, not 9 alone)."""
    manager = BlockManager(num_blocks=10, block_size=4)
    compute(manager, make_request("a", 9), 9)
    assert len(manager.computed_prefix(make_request("b", 9))) == 1
    assert len(manager.computed_prefix(make_request("c", 10))) == 2
    assert manager.computed_prefix(make_request("d", 1)) == []
