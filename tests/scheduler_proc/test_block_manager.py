"""KV block accounting: allocation, freeing, usage and the invariant checker itself."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.sampling import SamplingParams
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.request import Request, RequestStatus
from scheduler_proc.stop import BiasTriples

_NO_BIAS = BiasTriples(np.empty(0, np.int32), np.empty(0, np.float32))


def make_request(request_id: str, num_prompt_tokens: int = 4) -> Request:
    request = Request(request_id, np.arange(num_prompt_tokens, dtype=np.int32), SamplingParams(), seed=0,
                      arrival_time_s=0.0, stop_token_ids=frozenset(), logit_bias=_NO_BIAS,
                      min_tokens_logit_bias=_NO_BIAS, max_num_kv_tokens=num_prompt_tokens + 15)
    request.status = RequestStatus.RUNNING
    return request


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


def test_free_returns_every_block_and_blocks_are_reused_least_recently_freed_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    first, second = make_request("a"), make_request("b")
    manager.allocate(first, 4)
    manager.allocate(second, 4)
    manager.free(first)
    assert len(first.block_ids) == 0 and manager.num_free_blocks == 2
    manager.check_invariants()
    third = make_request("c")
    manager.allocate(third, 4)
    assert sorted(third.block_ids.tolist()) == [0, 1]
    manager.free(second)
    manager.free(third)
    assert manager.usage == 0.0
    manager.check_invariants()


def test_check_invariants_catches_a_block_owned_twice() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    first, second = make_request("a"), make_request("b")
    manager.allocate(first, 2)
    manager.allocate(second, 2)
    second.block_table.clear()
    second.block_table.extend(first.block_ids)
    with pytest.raises(AssertionError):
        manager.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), max_size=60))
def test_any_sequence_of_allocations_and_frees_keeps_the_invariants(ops: list[tuple[int, int]]) -> None:
    manager = BlockManager(num_blocks=16, block_size=4)
    requests = [make_request(f"r{i}") for i in range(6)]
    for index, num_tokens in ops:
        request = requests[index]
        if num_tokens == 0:
            manager.free(request)
        else:
            before = len(request.block_ids)
            ok = manager.allocate(request, num_tokens)
            assert ok or len(request.block_ids) == before
            assert not ok or len(request.block_ids) * 4 >= num_tokens
        manager.check_invariants()
