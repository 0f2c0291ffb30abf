"""ModelRunner: one rank's weights and KV cache; executes a StepPlan synchronously (no sockets)."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from proto.config import EngineConfig
from proto.logprobs import concat_entries
from proto.messages import StepPlan, StepResult
from worker_proc import parallel
from worker_proc.attention import AttentionShape, attention_backend_for
from worker_proc.batch import StepBatch, build_step_batch, synthetic_plan
from worker_proc.devices import bind_worker
from worker_proc.grammar_mask import apply_plan_masks_
from worker_proc.kv_cache import (
    GPUMemory,
    allocate_kv_cache,
    gather_scratch_bytes,
    gpu_kv_budget_bytes,
    num_kv_blocks_for,
)
from worker_proc.layers.linear import cpu_prepack_supported
from worker_proc.layers.fused_cpu import fused_cpu_ops_for
from worker_proc.layers.native_decoder import native_decoder_for
from worker_proc.layers.skinny import skinny_linear_for
from worker_proc.loader import load_model
from worker_proc.logprobs import (
    PromptTargets,
    compute_entries,
    prompt_targets,
    sampled_asks,
)
from worker_proc.model_config import load_model_config, torch_dtype
from worker_proc.null_runner import NullModelRunner
from worker_proc.sampler import sample, sampling_batch_from_plan

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns one rank's model weights and KV cache tensors. Every rank executes every plan (the
    collectives need all of them); only rank 0's tokens are sent back."""

    def __init__(self, config: EngineConfig, rank: int, show_progress: bool = True) -> None:
        self.device = bind_worker(config, rank)
        parallel.init_parallel(rank, config)
        self.config = config
        self.rank = rank
        started = time.perf_counter()
        log.info("rank %d loading model from %s (%s, KV cache %s, %d threads)", rank, config.model,
                 config.dtype, config.kv_dtype, torch.get_num_threads())
        dtype, self.kv_dtype = torch_dtype(config.dtype), torch_dtype(config.kv_dtype)
        shape = AttentionShape.for_rank(load_model_config(config.model), config.tensor_parallel_size)
        # Attention reads the cache's dtype (model.Attention casts to it and back, except for a
        # backend that widens a narrower cache itself: AttentionBackend.mixed_dtypes).
        self.attention = attention_backend_for(self.device, self.kv_dtype, config.block_size,
                                               config.attention_backend, config.cpu_isa, shape, dtype)
        self.model = load_model(config.model, config.dtype, self.attention, self.device,
                                show_progress=show_progress and rank == 0)
        if self.device.type == "cpu" and cpu_prepack_supported(dtype):
            self.model.pack_for_cpu(skinny_linear_for(dtype, config.cpu_isa),
                                    fused_cpu_ops_for(dtype, config.cpu_isa))
            self.model.native_decoder = native_decoder_for(self.model, self.attention, self.kv_dtype, config.cpu_isa,
                                                           config.tensor_parallel_size)
            packed = [m.skinny for m in self.model.modules() if getattr(m, "skinny", None) is not None]
            if any(weight.widened for weight in packed):
                log.info("linears: %d of %d weights kept as bf16, which holds every value of them exactly; "
                         "widened to fp32 as they load", sum(w.widened for w in packed), len(packed))
        gpu_budget = None
        if self.device.type == "cuda" and not config.num_kv_blocks:
            gpu_budget = self._gpu_kv_budget()
        self.num_kv_blocks = num_kv_blocks_for(config, self.model.config, self.kv_dtype, gpu_budget)
        self.kv_cache = allocate_kv_cache(self.model.config, self.num_kv_blocks, config.block_size,
                                          self.kv_dtype, config.tensor_parallel_size, self.device,
                                          self.attention.kv_layout)
        self.kv_views = self.kv_cache.flat_views()
        log.info("rank %d ready in %.1f s: %d KV blocks of %d tokens", rank,
                 time.perf_counter() - started, self.num_kv_blocks, config.block_size)

    def _gpu_kv_budget(self) -> int:
        """Bytes the KV cache may take on this GPU: what the largest step and the attention
        scratch leave of the --gpu-memory-utilization share (kv_cache.gpu_kv_budget_bytes)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        num_tokens = self.profile_step()
        torch.cuda.synchronize()
        memory = GPUMemory.measure()
        torch.cuda.empty_cache()
        scratch = 0
        if self.attention.gathers_context:
            scratch = gather_scratch_bytes(self.config, self.model.config, self.kv_dtype,
                                           self.config.max_model_len)
        budget = gpu_kv_budget_bytes(memory, self.config.gpu_memory_utilization, num_tokens, scratch)
        log.info("rank %d: a %d-token step peaks at %.2f GiB, attention scratch %.2f GiB; %.2f GiB "
                 "left for the KV cache", self.rank, num_tokens, memory.peak_allocated_bytes / (1 << 30),
                 scratch / (1 << 30), budget / (1 << 30))
        return budget

    @torch.inference_mode()
    def profile_step(self) -> int:
        """Run the largest step the scheduler can plan through a throwaway KV cache just large
        enough, so that activations reach their peak: max_num_batched_tokens fresh prompt tokens
        in as few members as max_model_len allows, with the LM head over every token (the most
        rows a step can ask for: sampling rows plus prompt-logprob rows). Returns the token count.
        Every rank runs it at start-up (the collectives need all of them)."""
        config = self.config
        num_tokens = config.max_num_batched_tokens
        full, rest = divmod(num_tokens, config.max_model_len)  # the supervisor resolved it (>= 1)
        contexts = np.array([config.max_model_len] * full + ([rest] if rest else []))
        max_blocks = -(-int(contexts.max()) // config.block_size)
        num_blocks = len(contexts) * max_blocks
        scratch = allocate_kv_cache(self.model.config, num_blocks, config.block_size,
                                    self.kv_dtype, config.tensor_parallel_size, self.device,
                                    self.attention.kv_layout)
        plan = synthetic_plan(0, contexts, contexts, np.zeros(num_tokens, np.int64), max_blocks)
        batch = build_step_batch(plan, config.block_size, num_blocks, self.attention).to(self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, scratch.flat_views())
        self.model.compute_logits(hidden)
        return num_tokens

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Rank 0 answers with one token per sample_mask member (batch order) and
        the logprob entries asked for; every other rank runs the same collectives and answers
        with nothing. The LM head runs only for sampling rows and prompt-logprob rows."""
        if plan.num_seqs == 0:
            return empty_result(plan.step_id, self.rank)
        batch = self._batch(plan)
        targets = prompt_targets(plan)
        rows = torch.cat([batch.logits_indices, torch.from_numpy(targets.token_rows).to(self.device)])
        if len(rows) < len(batch.input_ids):  # the last layer's MLP only for the rows the LM head reads
            hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_views, rows)
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_views)[rows]
        if not len(rows):
            return empty_result(plan.step_id, self.rank)
        logits = self.model.compute_logits(hidden).cpu()  # float32 [rows, vocab]; collective
        if self.rank != 0:
            return empty_result(plan.step_id, self.rank)
        return self._answer(plan, batch, targets, logits)

    def _answer(self, plan: StepPlan, batch: StepBatch, targets: PromptTargets,
                logits: torch.Tensor) -> StepResult:
        """logits: float32 [num_sampled + num_prompt_entries, vocab], sampling rows first."""
        num_sampled = len(batch.sample_members)
        sample_logits = logits[:num_sampled]
        mask_error = apply_plan_masks_(sample_logits, plan, batch.sample_members)  # structured output
        if mask_error:
            return StepResult(step_id=plan.step_id, sampled_token_ids=np.zeros(0, dtype=np.int32), error=mask_error)
        asks = sampled_asks(plan, batch.sample_members)  # bool [num_sampled]
        # Taken before sample(), which adjusts the logits in place: logprobs are of the raw model
        # (masked to the grammar's tokens on a constrained row).
        raw = torch.log_softmax(sample_logits[torch.from_numpy(asks)], dim=-1) if asks.any() else None
        tokens = torch.zeros(0, dtype=torch.int64)
        if num_sampled:
            params = sampling_batch_from_plan(plan, batch.sample_members, batch.sample_positions)
            tokens = sample(sample_logits, params)
        parts = []
        if targets.num_entries:
            parts.append(compute_entries(torch.log_softmax(logits[num_sampled:], dim=-1),
                                         torch.from_numpy(targets.token_ids), targets.members,
                                         targets.positions, targets.num_top, with_ranks=True))
        if raw is not None:
            members = batch.sample_members[asks]
            num_top = plan.sampling.logprobs[members]
            if len(plan.grammar):  # a masked-out token has no logprob: no more alternatives than allowed tokens
                num_top = np.minimum(num_top, torch.isfinite(raw).sum(dim=-1).numpy())
            parts.append(compute_entries(raw, tokens[torch.from_numpy(asks)], members,
                                         batch.sample_positions[asks], num_top, with_ranks=False))
        return StepResult(step_id=plan.step_id, sampled_token_ids=tokens.numpy().astype(np.int32),
                          error="", logprobs=concat_entries(parts))

    @torch.inference_mode()
    def logits_for_all_tokens(self, plan: StepPlan) -> torch.Tensor:
        """Run the step like execute (its K/V are cached) but return float32 [num_tokens, vocab]
        logits for every token and sample nothing: the parity tests' view of the model."""
        batch = self._batch(plan)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_views)
        return self.model.compute_logits(hidden).cpu()

    def _batch(self, plan: StepPlan) -> StepBatch:
        return build_step_batch(plan, self.config.block_size, self.num_kv_blocks,
                                self.attention).to(self.device)


def empty_result(step_id: int, rank: int) -> StepResult:
    return StepResult(step_id=step_id, sampled_token_ids=np.zeros(0, dtype=np.int32), error="",
                      rank=rank)


def create_runner(config: EngineConfig, rank: int) -> ModelRunner | NullModelRunner:
    """The real runner, or the null one when config.null_model asks for scheduler+IPC timing only."""
    if config.null_model:
        return NullModelRunner(config, rank)
    return ModelRunner(config, rank)
