"""Tensor-parallel rank, world size and collectives over torch.distributed; no-ops at world size 1."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from proto.config import EngineConfig


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int


_state = ParallelState(rank=0, world_size=1)
_group: dist.ProcessGroup | None = None  # the collectives' group, with the step-level timeout


def init_method_for(config: EngineConfig) -> str:
    """A file in the private runtime dir on one node, one per worker generation (a replaced group
    must not read the lost one's rendezvous); node 0's master address across nodes (see
    rendezvous_store for how generations are kept apart there)."""
    if config.nnodes > 1:
        host = f"[{config.master_addr}]" if ":" in config.master_addr else config.master_addr
        return f"tcp://{host}:{config.master_port}"
    name = f"torch-dist-init-{config.worker_generation}"
    return f"file://{os.path.join(config.runtime_dir, name)}"


def rendezvous_prefix(generation: int) -> str:
    return f"conveyor-worker-group-{generation}/"


def rendezvous_store(rank: int, config: EngineConfig) -> dist.Store:
    """Across nodes: the TCPStore on node 0's master port (rank 0 hosts it), every key under the
    worker generation's prefix. A rank of another generation (a stale one, or a new one started
    before its group) writes and waits on other keys, so it can never complete this group's
    rendezvous nor count as one of its ranks; it times out after ready_timeout_s instead."""
    store = dist.TCPStore(config.master_addr, config.master_port, config.tensor_parallel_size,
                          is_master=rank == 0, timeout=timedelta(seconds=config.ready_timeout_s),
                          wait_for_workers=False)
    return dist.PrefixStore(rendezvous_prefix(config.worker_generation), store)


def init_parallel(rank: int, config: EngineConfig) -> None:
    """Join the tensor-parallel group (NCCL on GPU, gloo on CPU); at world size 1 nothing is
    initialised. Joining waits up to ready_timeout_s for every rank (nodes start at different
    times); a collective waits at most half the step timeout for a peer, so a rank whose peer hangs
    or died still answers its step (with an error) and the scheduler names the silent rank."""
    global _state, _group
    world_size = config.tensor_parallel_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        where = (dict(store=rendezvous_store(rank, config)) if config.nnodes > 1
                 else dict(init_method=init_method_for(config)))
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=config.ready_timeout_s), **where)
        _group = dist.new_group(list(range(world_size)),
                                timeout=timedelta(seconds=config.step_timeout_s / 2))
    _state = ParallelState(rank=rank, world_size=world_size)


def get_rank() -> int:
    return _state.rank


def get_world_size() -> int:
    return _state.world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place)."""
    if _state.world_size > 1:
        dist.all_reduce(x, group=_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard along the last dim (vocab-parallel logits)."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_group)
    return torch.cat(parts, dim=-1)


def kv_heads_per_rank(num_kv_heads: int, world_size: int) -> int:
    """KV heads are split when there are at least as many as ranks, else each rank holds one
    replica (world_size must then be a multiple of num_kv_heads)."""
    if num_kv_heads >= world_size:
        return divide(num_kv_heads, world_size, "num_key_value_heads")
    if world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({world_size}) must divide num_key_value_heads "
                         f"({num_kv_heads}) or be a multiple of it")
    return 1


def kv_head_shard(rank: int, num_kv_heads: int, world_size: int) -> int:
    """Which slice of kv_heads_per_rank heads rank `rank` holds; ranks sharing a replica share
    the slice (with query heads split evenly, rank r's queries use exactly these heads)."""
    if num_kv_heads >= world_size:
        return rank
    return rank // (world_size // num_kv_heads)


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact split of a dimension across ranks, with a message naming the dimension."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator
