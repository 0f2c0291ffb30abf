"""Tensor-parallel rank, world size and collectives over torch.distributed; no-ops at world size 1."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int


_state = ParallelState(rank=0, world_size=1)


def init_parallel(rank: int, world_size: int, runtime_dir: str) -> None:
    """Join the tensor-parallel group; at world size 1 nothing is initialised (no gloo, no files)."""
    global _state
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # A file rendezvous in the private runtime dir needs no free port and no extra config field.
        init_method = f"file://{os.path.join(runtime_dir, 'torch-dist-init')}"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    _state = ParallelState(rank=rank, world_size=world_size)


def get_rank() -> int:
    return _state.rank


def get_world_size() -> int:
    return _state.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place)."""
    if _state.world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard along the last dim (vocab-parallel logits)."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact split of a dimension across ranks, with a message naming the dimension."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
