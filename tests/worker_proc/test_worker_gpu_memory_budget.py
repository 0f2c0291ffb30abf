"""How a GPU worker sizes its KV cache: the --gpu-memory-utilization share less what the largest
step and everything outside torch take. The arithmetic and the profile step run on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import tiny_config

from proto.errors import ValidationError
from worker_proc.kv_cache import (GPUMemory, gather_scratch_bytes, gpu_kv_budget_bytes, kv_bytes_per_block,
                                  num_kv_blocks_for)
from worker_proc.model_config import DTYPES, load_model_config
from worker_proc.runner import ModelRunner

GIB = 1 << 30


def test_the_kv_budget_is_the_share_less_the_peak_and_memory_outside_torch() -> None:
    # 80 GiB GPU; 20 GiB used on the device, of which torch reserves 18 (2 GiB CUDA context etc.)
    memory = GPUMemory(total_bytes=80 * GIB, free_bytes=60 * GIB, peak_allocated_bytes=17 * GIB,
                       reserved_bytes=18 * GIB)
    assert gpu_kv_budget_bytes(memory, 0.9, 2048) == int(80 * GIB * 0.9) - 17 * GIB - 2 * GIB
    # a gathering attention backend's scratch comes off the budget too
    assert gpu_kv_budget_bytes(memory, 0.9, 2048, 3 * GIB) == int(80 * GIB * 0.9) - 22 * GIB


def test_the_gather_scratch_covers_every_seat_at_the_longest_context(tiny_model_dir: Path) -> None:
    config = tiny_config(tiny_model_dir, max_num_seqs=8)
    model = load_model_config(tiny_model_dir)
    per_token = 2 * model.num_kv_heads * model.head_dim * 4  # K and V, fp32
    assert gather_scratch_bytes(config, model, torch.float32, 100) == 8 * 100 * per_token * 5 // 4


def test_a_share_too_small_for_the_model_says_what_to_change() -> None:
    memory = GPUMemory(total_bytes=16 * GIB, free_bytes=2 * GIB, peak_allocated_bytes=13 * GIB,
                       reserved_bytes=14 * GIB)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 0.5 allows 8.00 GiB .* "
                                         r"2048-token step .* raise --gpu-memory-utilization"):
        gpu_kv_budget_bytes(memory, 0.5, 2048)


def test_the_measured_budget_sets_the_block_count_on_a_gpu(tiny_model_dir: Path) -> None:
    config = tiny_config(tiny_model_dir, num_kv_blocks=0, kv_cache_memory_bytes=GIB)
    model = load_model_config(tiny_model_dir)
    per_block = kv_bytes_per_block(model, config.block_size, torch.float32, 1)
    assert num_kv_blocks_for(config, model, torch.float32, 10 * per_block + 1) == 10
    assert num_kv_blocks_for(config, model, torch.float32) == GIB // per_block  # the CPU budget
    with pytest.raises(ValueError, match="GPU memory left for the KV cache"):
        num_kv_blocks_for(config, model, torch.float32, per_block - 1)


def test_the_profile_step_runs_the_largest_step_the_scheduler_can_plan(tiny_model_dir: Path) -> None:
    config = tiny_config(tiny_model_dir, max_num_batched_tokens=96, max_model_len=64)
    runner = ModelRunner(config, rank=0, show_progress=False)
    assert runner.profile_step() == 96  # two members (64 + 32 tokens), as the scheduler may plan
    assert DTYPES[config.dtype] == runner.kv_cache.k_blocks[0].dtype  # the real cache is untouched
    assert not any(k.any() for k in runner.kv_cache.k_blocks)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_outside_zero_to_one_is_refused(tiny_model_dir: Path, value: float) -> None:
    with pytest.raises(ValidationError, match=f"gpu_memory_utilization must be in \\(0, 1\\], got {value}"):
        tiny_config(tiny_model_dir, gpu_memory_utilization=value)
