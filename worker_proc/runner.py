"""ModelRunner: one rank's weights and KV cache; executes a StepPlan synchronously (no sockets)."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from proto.config import EngineConfig
from proto.messages import StepPlan
from worker_proc import parallel
from worker_proc.attention import TorchPagedAttention
from worker_proc.batch import StepBatch, build_step_batch
from worker_proc.kv_cache import allocate_kv_cache, num_kv_blocks_for
from worker_proc.layers.linear import cpu_prepack_available
from worker_proc.loader import load_model
from worker_proc.model_config import DTYPES
from worker_proc.null_runner import NullModelRunner
from worker_proc.sampler import sample, sampling_batch_from_plan

log = logging.getLogger(__name__)


def num_threads_for(config: EngineConfig) -> int:
    if config.num_threads > 0:
        return config.num_threads
    # The affinity mask, not the machine, is what this process may use (containers, taskset).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // config.tensor_parallel_size)


def pick_device() -> torch.device:
    """The supervisor pins a worker to one GPU via CUDA_VISIBLE_DEVICES, so it is always cuda:0."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class ModelRunner:
    """Owns one rank's model weights and KV cache tensors. Every rank executes every plan (the
    collectives need all of them); only rank 0's tokens are sent back."""

    def __init__(self, config: EngineConfig, rank: int, show_progress: bool = True) -> None:
        torch.set_num_threads(num_threads_for(config))
        parallel.init_parallel(rank, config.tensor_parallel_size, config.runtime_dir)
        self.config = config
        self.rank = rank
        self.device = pick_device()
        started = time.perf_counter()
        log.info("rank %d loading model from %s (%s, %d threads)", rank, config.model, config.dtype,
                 torch.get_num_threads())
        self.model = load_model(config.model, config.dtype, TorchPagedAttention(), self.device,
                                show_progress=show_progress and rank == 0)
        if self.device.type == "cpu" and cpu_prepack_available():
            self.model.pack_for_cpu()
        dtype = DTYPES[config.dtype]
        self.num_kv_blocks = num_kv_blocks_for(config, self.model.config, dtype)
        self.kv_cache = allocate_kv_cache(self.model.config, self.num_kv_blocks, config.block_size,
                                          dtype, config.tensor_parallel_size, self.device)
        self.kv_views = self.kv_cache.flat_views()
        log.info("rank %d ready in %.1f s: %d KV blocks of %d tokens", rank,
                 time.perf_counter() - started, self.num_kv_blocks, config.block_size)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> np.ndarray:
        """Run one step; returns int32 [num_sampled]: a token per sample_mask member, in batch order."""
        if plan.num_seqs == 0:
            return np.empty(0, dtype=np.int32)
        batch, hidden = self._forward(plan)
        if not len(batch.sample_members):
            return np.empty(0, dtype=np.int32)
        logits = self.model.compute_logits(hidden[batch.logits_indices]).cpu()
        params = sampling_batch_from_plan(plan, batch.sample_members, batch.sample_positions)
        return sample(logits, params).numpy().astype(np.int32)

    @torch.inference_mode()
    def logits_for_all_tokens(self, plan: StepPlan) -> torch.Tensor:
        """Run the step like execute (its K/V are cached) but return float32 [num_tokens, vocab]
        logits for every token and sample nothing: the parity tests' view of the model."""
        _, hidden = self._forward(plan)
        return self.model.compute_logits(hidden).cpu()

    def _forward(self, plan: StepPlan) -> tuple[StepBatch, torch.Tensor]:
        batch = build_step_batch(plan, self.config.block_size, self.num_kv_blocks).to(self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_views)
        return batch, hidden


def create_runner(config: EngineConfig, rank: int) -> ModelRunner | NullModelRunner:
    """The real runner, or the null one when config.null_model asks for scheduler+IPC timing only."""
    if config.null_model:
        return NullModelRunner(config, rank)
    return ModelRunner(config, rank)
