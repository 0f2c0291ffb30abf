"""Where one worker rank runs: its GPU (pinned by the supervisor) or its share of the CPU cores."""

from __future__ import annotations

import logging
import os

import torch

from proto.config import EngineConfig

log = logging.getLogger(__name__)

# On node 0 the frontend and the scheduler share the workers' cores. Leaving them a core costs
# the workers 1/cores of their compute; sharing cost about 20% on 2 cores (a 48-request burst
# served with the client on the same cores: 2 threads 1.41x faster than 1, while 2 threads
# alone are 1.45-1.77x faster; docs/benchmarks.md). So a core is left only where it costs less.
RESERVE_A_CORE_FROM = 5


def local_rank_of(config: EngineConfig, rank: int) -> int:
    """The rank's index among this node's workers."""
    return rank - config.node_rank * config.workers_per_node


def allowed_cores() -> list[int]:
    """The affinity mask, not the machine, is what this process may use (containers, taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def worker_cores(config: EngineConfig) -> list[int]:
    """The cores this node's workers may use: all allowed ones, less one on node 0 when there are
    at least RESERVE_A_CORE_FROM and one to spare beyond a core per worker."""
    cores = allowed_cores()
    if (config.node_rank == 0 and len(cores) >= RESERVE_A_CORE_FROM
            and len(cores) > config.workers_per_node):
        return cores[:-1]
    return cores


def cpu_share(cores: list[int], local_rank: int, workers_per_node: int) -> list[int]:
    """Rank local_rank's contiguous slice of `cores`: an even split, the remainder to the first
    ranks. With fewer cores than workers every worker shares them all."""
    if len(cores) < workers_per_node:
        return cores
    base, extra = divmod(len(cores), workers_per_node)
    start = local_rank * base + min(local_rank, extra)
    return cores[start:start + base + (1 if local_rank < extra else 0)]


def bind_worker(config: EngineConfig, rank: int) -> torch.device:
    """Pin this process and set its torch threads; returns the device its tensors live on.

    GPU: the supervisor set CUDA_VISIBLE_DEVICES to this rank's one device, so it is cuda:0.
    CPU threads (the whole model on CPU; sampling on GPU): this node's workers split the cores,
    each pinned to its slice so no two ranks' thread pools fight over a core, one thread per
    core unless num_threads says otherwise. On node 0 with RESERVE_A_CORE_FROM cores or more,
    one core is left to the frontend and scheduler: an OpenMP thread that loses its core to them
    stalls every op at the next barrier. On fewer cores that stall costs less than the core.
    """
    share = cpu_share(worker_cores(config), local_rank_of(config, rank), config.workers_per_node)
    if config.workers_per_node > 1 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, share)
    torch.set_num_threads(config.num_threads or len(share))
    if config.num_threads > len(share):
        log.warning("rank %d: --num-threads %d is more than its %d cores; threads that share a core "
                    "stall every op at the next barrier (leave --num-threads out: one per core)",
                    rank, config.num_threads, len(share))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    log.info("rank %d on %s, CPU cores %s, %d threads, %s", rank, device, share, torch.get_num_threads(),
             "tcmalloc" if _tcmalloc_loaded() else "glibc's malloc")
    return device


def _tcmalloc_loaded() -> bool:
    """Whether the supervisor's LD_PRELOAD of tcmalloc took (deploy/allocator.py)."""
    try:
        with open("/proc/self/maps") as maps:
            return "tcmalloc" in maps.read()
    except OSError:
        return False
