"""Turns a StepPlan into flat model inputs and attention metadata, once per step (numpy, O(tokens))."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from proto.messages import StepPlan
from proto.sampling import SamplingParams
from proto.sampling_columns import SamplingColumns
from worker_proc.attention import AttentionBackend, RaggedBatch, to_device


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    attn: Any  # the attention backend's own metadata (AttentionBackend.build_metadata)
    logits_indices: torch.Tensor  # int64 [num_sampled] last token row of each sampling member
    sample_members: np.ndarray  # int64 [num_sampled] member index of each sampled row
    sample_positions: np.ndarray  # int64 [num_sampled] position the sampled token will occupy

    def to(self, device: torch.device) -> StepBatch:
        """Built on the CPU from numpy; moved once per step when the model lives elsewhere."""
        if device.type == "cpu":
            return self
        return replace(self, input_ids=self.input_ids.to(device, non_blocking=True),
                       positions=self.positions.to(device, non_blocking=True),
                       attn=to_device(self.attn, device),
                       logits_indices=self.logits_indices.to(device, non_blocking=True))


def build_step_batch(plan: StepPlan, block_size: int, num_kv_blocks: int,
                     attention: AttentionBackend) -> StepBatch:
    """Raises ValueError (naming the member) when a block table cannot hold the member's context.
    The attention metadata is what `attention` reads, built from the flattened step."""
    num_scheduled = plan.num_scheduled_tokens.astype(np.int64)
    num_computed = plan.num_computed_tokens.astype(np.int64)
    context_lens = num_computed + num_scheduled  # int64 [num_seqs]
    cu_seqlens_q = np.zeros(plan.num_seqs + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=cu_seqlens_q[1:])
    num_tokens = int(cu_seqlens_q[-1])
    member = np.repeat(np.arange(plan.num_seqs), num_scheduled)  # int64 [num_tokens]
    positions = num_computed[member] + (np.arange(num_tokens) - cu_seqlens_q[member])
    ragged = RaggedBatch(block_size=block_size, num_computed=num_computed, num_scheduled=num_scheduled,
                         context_lens=context_lens, cu_seqlens_q=cu_seqlens_q, token_members=member,
                         positions=positions,
                         block_tables=_padded_block_tables(plan, context_lens, block_size, num_kv_blocks))
    sample_members = np.flatnonzero(plan.sample_mask)
    return StepBatch(
        input_ids=torch.from_numpy(plan.input_ids.astype(np.int64)),
        positions=torch.from_numpy(positions),
        attn=attention.build_metadata(ragged),
        logits_indices=torch.from_numpy(cu_seqlens_q[sample_members + 1] - 1),
        sample_members=sample_members,
        sample_positions=context_lens[sample_members],
    )


def _padded_block_tables(plan: StepPlan, context_lens: np.ndarray, block_size: int,
                         num_kv_blocks: int) -> np.ndarray:
    """int64 [num_seqs, max_blocks]; rows shorter than max_blocks are padded with block 0."""
    blocks_per_seq = np.diff(plan.cu_block_ids).astype(np.int64)
    short = np.flatnonzero(blocks_per_seq * block_size < context_lens)
    if len(short):
        i = int(short[0])
        raise ValueError(f"member {plan.request_ids[i]!r} has {blocks_per_seq[i]} KV blocks of "
                         f"{block_size} tokens for a context of {context_lens[i]} tokens")
    if len(plan.block_ids) and (plan.block_ids.min() < 0 or plan.block_ids.max() >= num_kv_blocks):
        raise ValueError(f"block ids must be in [0, {num_kv_blocks}), got "
                         f"[{plan.block_ids.min()}, {plan.block_ids.max()}]")
    max_blocks = int(blocks_per_seq.max())
    offsets = np.arange(max_blocks)
    index = plan.cu_block_ids[:-1, None].astype(np.int64) + offsets
    valid = offsets < blocks_per_seq[:, None]
    return np.where(valid, plan.block_ids.astype(np.int64)[np.where(valid, index, 0)], 0)


def synthetic_plan(step_id: int, contexts: np.ndarray, num_scheduled: np.ndarray,
                   input_ids: np.ndarray, max_blocks: int) -> StepPlan:
    """A plan of greedy members with contexts[i] tokens, the last num_scheduled[i] of them
    computed now; member i owns blocks [i * max_blocks, (i + 1) * max_blocks). For benchmarks and
    the GPU memory profile step."""
    n = len(contexts)
    i32 = np.int32
    return StepPlan(
        step_id=step_id, request_ids=[f"r{i}" for i in range(n)], input_ids=input_ids.astype(i32),
        num_computed_tokens=(contexts - num_scheduled).astype(i32),
        num_scheduled_tokens=num_scheduled.astype(i32),
        cu_block_ids=(np.arange(n + 1) * max_blocks).astype(i32),
        block_ids=np.arange(n * max_blocks, dtype=i32), sample_mask=np.ones(n, bool),
        sampling=SamplingColumns.of_params([SamplingParams(temperature=0.0)] * n))
