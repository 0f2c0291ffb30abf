"""The supervisor's view of this node's GPUs (without torch) and how each worker is pinned to one."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from deploy.allocator import allocator_env
from deploy.cpu_isa import torch_isa_env
from proto.config import EngineConfig
from proto.errors import ValidationError

_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver sees


def visible_gpus(environ: dict[str, str] | None = None, driver_dir: Path = _NVIDIA_GPUS) -> list[str]:
    """CUDA_VISIBLE_DEVICES identifiers of the GPUs this process may use, in CUDA's order.

    CUDA_VISIBLE_DEVICES, when set, is the list (indices or UUIDs; '' or '-1' = none); else every
    GPU the NVIDIA driver lists. A machine without the driver has none.
    """
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [part.strip() for part in env["CUDA_VISIBLE_DEVICES"].split(",") if part.strip()]
        return [] if ids[:1] == ["-1"] else ids
    if driver_dir.is_dir():
        return [str(i) for i in range(len(list(driver_dir.iterdir())))]
    return []


def lowest_compute_capability(gpus: list[str], query: Callable[[], str] | None = None,
                              environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """The lowest CUDA compute capability among `gpus` (visible_gpus' ids: indices or UUIDs), from
    nvidia-smi (`query` returns its CSV: index, uuid, compute_cap per line); None when unknown.
    nvidia-smi numbers GPUs in PCI bus order and CUDA, unless CUDA_DEVICE_ORDER=PCI_BUS_ID, does
    not: an index then matches any GPU, so the lowest of them all is taken."""
    env = os.environ if environ is None else environ
    try:
        text = (query or _nvidia_smi_capabilities)()
    except (OSError, subprocess.SubprocessError):
        return None
    indices_match = env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    found = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3:
            continue
        index, uuid, capability = parts
        if uuid not in gpus and not any(gpu.isdigit() and (gpu == index or not indices_match) for gpu in gpus):
            continue
        try:
            major, minor = capability.split(".")
            found.append((int(major), int(minor)))
        except ValueError:
            continue
    return min(found, default=None)


def _nvidia_smi_capabilities() -> str:
    return subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,compute_cap", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=10, check=True).stdout


def check_devices(config: EngineConfig, gpus: list[str]) -> None:
    """Refuse --devices that do not exist, or a GPU node with fewer GPUs than workers."""
    wanted = list(config.devices) or list(range(config.workers_per_node))
    if config.devices and not gpus:
        raise ValidationError(f"--devices {','.join(map(str, config.devices))} names GPUs, but this "
                              "machine has none visible (no NVIDIA driver, or CUDA_VISIBLE_DEVICES "
                              "hides them); leave --devices out to run on the CPU", "devices")
    if gpus and max(wanted) >= len(gpus):
        remedy = (f"name GPUs 0-{len(gpus) - 1} in --devices" if config.devices else
                  "lower --tensor-parallel-size or spread the ranks over nodes with --nnodes")
        raise ValidationError(f"{config.workers_per_node} workers on this node need GPUs "
                              f"{','.join(map(str, wanted))}, but only {len(gpus)} "
                              f"{'is' if len(gpus) == 1 else 'are'} visible ({','.join(gpus)}): {remedy}, "
                              "or run the workers on the CPU with CUDA_VISIBLE_DEVICES=''", "devices")


def worker_env(config: EngineConfig, local_rank: int, gpus: list[str]) -> dict[str, str]:
    """Environment overrides for one worker: CUDA_VISIBLE_DEVICES = its one GPU (so it is
    cuda:0 inside); on a CPU node, torch's ISA cap when --cpu-isa / CONVEYOR_CPU_ISA sets one
    (the worker splits the cores itself), torch's CPU allocator asked for transparent huge
    pages (THP_MEM_ALLOC_ENABLE, unless the environment sets it): the KV cache and the weights
    then span 2 MiB pages, and the kernels streaming them stop missing the TLB and restarting the
    hardware prefetcher every 4 KiB (docs/benchmarks.md "Huge pages"); and tcmalloc preloaded
    when CONVEYOR_MALLOC asks for it (deploy/allocator.py)."""
    if not gpus:
        return {**torch_isa_env(config.cpu_isa),
                "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1"),
                **allocator_env(dict(os.environ))}
    index = config.devices[local_rank] if config.devices else local_rank
    return {"CUDA_VISIBLE_DEVICES": gpus[index]}
