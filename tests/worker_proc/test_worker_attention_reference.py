"""The torch reference backend: this step's K/V land heads-major at their slots, and decodes
batched in one or two length groups equal attending each member on its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from worker_plans import BlockPool, Seq, make_plan

from proto.messages import StepPlan
from worker_proc.attention.reference import TorchPagedAttention
from worker_proc.batch import build_step_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 8, 4, 512


def step(context_lens: list[int], num_scheduled: list[int]) -> StepPlan:
    pool = BlockPool(NUM_BLOCKS, block_size=BLOCK_SIZE)
    seqs = [Seq(f"r{i}", list(range(n)), num_computed=n - s)
            for i, (n, s) in enumerate(zip(context_lens, num_scheduled))]
    return make_plan(seqs, num_scheduled, pool)


def attend_each_member(plan: StepPlan, q: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> torch.Tensor:
    """Every member on its own, in fp32, from [kv_heads, num_slots, head_dim] caches."""
    out = torch.empty(q.shape)
    token_start = 0
    for i, num_q in enumerate(plan.num_scheduled_tokens.tolist()):
        context = int(plan.num_computed_tokens[i]) + num_q
        blocks = torch.from_numpy(plan.block_ids[plan.cu_block_ids[i]:plan.cu_block_ids[i + 1]]).long()
        positions = torch.arange(context)
        slots = blocks[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        rows = slice(token_start, token_start + num_q)
        visible = positions[None, :] <= positions[-num_q:, None]  # bool [num_q, context]
        out[rows] = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1), k_cache[:, slots].float(), v_cache[:, slots].float(),
            attn_mask=visible, enable_gqa=True).transpose(0, 1)
        token_start += num_q
    return out


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("context_lens, num_scheduled, num_groups", [
    ([5, 7, 6], [1, 1, 1], 1),  # padded, in one group
    ([3, 905, 5, 910], [1, 1, 1, 1], 2),  # short and long: two groups save most of the padding
    ([3, 905, 12, 5, 910], [1, 1, 6, 1, 1], 2),  # the same beside a prefill chunk
])
def test_batched_decodes_equal_attending_each_member_alone(
        context_lens: list[int], num_scheduled: list[int], num_groups: int, dtype: torch.dtype,
        tolerance: float) -> None:
    plan = step(context_lens, num_scheduled)
    meta = build_step_batch(plan, BLOCK_SIZE, NUM_BLOCKS, TorchPagedAttention()).attn
    assert len(meta.decodes) == num_groups
    generator = torch.Generator().manual_seed(0)
    num_tokens, num_slots = sum(num_scheduled), NUM_BLOCKS * BLOCK_SIZE
    k_cache, v_cache = (torch.randn(NUM_KV_HEADS, num_slots, HEAD_DIM, generator=generator).to(dtype)
                        for _ in range(2))
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
            for _ in range(2))
    got = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta)
    # The step's own K/V were written heads-major at slot_mapping before anything attended.
    assert torch.equal(k_cache[:, meta.slot_mapping], k.transpose(0, 1))
    assert torch.equal(v_cache[:, meta.slot_mapping], v.transpose(0, 1))
    want = attend_each_member(plan, q, k_cache, v_cache)
    torch.testing.assert_close(got.float(), want.view(num_tokens, -1), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("context_lens, num_scheduled", [
    ([5, 7, 6], [1, 1, 1]),  # decodes
    ([3, 905, 12, 5, 910], [1, 1, 6, 1, 1]),  # beside a prefill chunk over cached context
    ([9, 4], [9, 1]),  # a whole prompt (its own K/V, not the cache's) beside a decode
])
def test_fp32_queries_over_a_bfloat16_cache_attend_in_fp32(context_lens: list[int],
                                                            num_scheduled: list[int]) -> None:
    """--kv-cache-dtype bfloat16 under an fp32 model: the cache stores K/V rounded to bf16, and
    attention computes in fp32 over what it holds (fp32 tolerance, where bf16 matmuls would be off
    by about 1e-2), so a CPU without native bf16 never multiplies bf16 in emulation."""
    backend = TorchPagedAttention()
    assert backend.mixed_dtypes
    plan = step(context_lens, num_scheduled)
    meta = build_step_batch(plan, BLOCK_SIZE, NUM_BLOCKS, backend).attn
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_slots = sum(num_scheduled), NUM_BLOCKS * BLOCK_SIZE
    k_cache, v_cache = (torch.randn(NUM_KV_HEADS, num_slots, HEAD_DIM, generator=generator).bfloat16()
                        for _ in range(2))
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    got = backend.forward(q, k, v, k_cache, v_cache, meta)
    assert got.dtype == torch.float32 and k_cache.dtype == torch.bfloat16
    assert torch.equal(k_cache[:, meta.slot_mapping].float(), k.transpose(0, 1).bfloat16().float())
    # every query sees K/V as cached, a prompt its own this step's too: whole or chunked, the same
    want = attend_each_member(plan, q, k_cache.float(), v_cache.float())
    torch.testing.assert_close(got, want.view(num_tokens, -1), atol=1e-5, rtol=1e-5)
