"""Across nodes the torch.distributed rendezvous is keyed by the worker generation: ranks of one
generation form their group; a rank of another generation (a stale one) cannot join it and times out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import free_port

from proto.config import EngineConfig

pytestmark = pytest.mark.cpu_workers  # gloo's group over CPU tensors, as on a CPU node
ROOT = Path(__file__).resolve().parents[2]
RANK_SCRIPT = """
import sys, torch
from proto.config import EngineConfig
from worker_proc import parallel
config = EngineConfig.from_json(sys.argv[1])
try:
    parallel.init_parallel(int(sys.argv[2]), config)
except Exception as exc:
    print("no group:", type(exc).__name__)
    sys.exit(3)
print("sum", int(parallel.all_reduce(torch.ones(1)).item()), flush=True)
torch.distributed.barrier()  # neither rank tears its group down while the other still uses it
torch.distributed.destroy_process_group()
"""


def two_ranks(generations: tuple[int, int]) -> list[tuple[int, str]]:
    """Run rank 0 and rank 1 (two "nodes") with these worker generations: (exit code, output)."""
    base = EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=free_port(),
                        insecure_transport=True, ready_timeout_s=4.0, step_timeout_s=8.0)
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT,
                               base.with_updates(node_rank=rank, worker_generation=generation).to_json(),
                               str(rank)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for rank, generation in enumerate(generations)]
    return [(rank.wait(timeout=60), rank.stdout.read().strip()) for rank in ranks]


def test_ranks_of_one_generation_form_a_group() -> None:
    assert two_ranks((1, 1)) == [(0, "sum 2"), (0, "sum 2")]


def test_a_rank_of_an_older_generation_cannot_join_the_new_group() -> None:
    results = two_ranks((1, 0))
    assert [code for code, _ in results] == [3, 3], results
    assert all(output.startswith("no group") for _, output in results)
