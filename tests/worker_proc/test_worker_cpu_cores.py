"""How a node's CPU cores are split between its workers, and when one is left to the frontend."""

from __future__ import annotations

import pytest

from proto.config import EngineConfig
from worker_proc.devices import RESERVE_A_CORE_FROM, cpu_share, worker_cores


@pytest.mark.parametrize("num_cores, node_rank, want", [
    (2, 0, [0, 1]),  # too few cores: the frontend shares them rather than take half the compute
    (RESERVE_A_CORE_FROM - 1, 0, list(range(RESERVE_A_CORE_FROM - 1))),
    (RESERVE_A_CORE_FROM, 0, list(range(RESERVE_A_CORE_FROM - 1))),  # one core left to the frontend
    (16, 0, list(range(15))),
    (16, 1, list(range(16))),  # worker-only nodes have no frontend to leave a core to
])
def test_node_zero_leaves_a_core_to_the_frontend_only_from_enough_cores(
        num_cores: int, node_rank: int, want: list[int]) -> None:
    config = EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=node_rank, master_addr="10.0.0.1")
    assert worker_cores(config, list(range(num_cores))) == want


def test_workers_never_lose_their_last_core_to_the_frontend() -> None:
    config = EngineConfig(tensor_parallel_size=RESERVE_A_CORE_FROM)
    assert worker_cores(config, list(range(RESERVE_A_CORE_FROM))) == list(range(RESERVE_A_CORE_FROM))


@pytest.mark.parametrize("cores, workers, want", [
    (list(range(7)), 2, [[0, 1, 2, 3], [4, 5, 6]]),  # the remainder goes to the first ranks
    ([0, 1], 4, [[0, 1]] * 4),  # fewer cores than workers: every worker shares them all
])
def test_workers_split_the_cores_evenly_and_contiguously(cores: list[int], workers: int,
                                                         want: list[list[int]]) -> None:
    assert [cpu_share(cores, rank, workers) for rank in range(workers)] == want
