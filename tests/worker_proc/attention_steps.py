"""Test helper: the native attention kernel built at each ISA level this CPU can run (or the test
skipped, with the reason), and one layer's attention step over random caches through any backend."""

from __future__ import annotations

import pytest
import torch
from worker_plans import BlockPool, Seq, make_plan

from deploy.cpu_isa import cpu_isa, rank, read_cpu_flags
from proto.messages import StepPlan
from worker_proc.attention import AttentionBackend
from worker_proc.attention import native_kernel as native
from worker_proc.batch import build_step_batch

NUM_BLOCKS = 64

MACHINE = cpu_isa(read_cpu_flags())
# Every ISA level this CPU can run, as the kernel is built for it ("" = -march=native), with the
# path its fp32 and bf16 variants take for head_dim 64 (test_worker_attention_native.py).
LEVELS = ["", *(level for level in ("baseline", "avx2", "avx512", "avx512_bf16")
                if rank(level) <= rank(MACHINE.detected))]


def load(level: str = "") -> native.PagedAttentionKernel:
    try:
        return native.load_paged_attention(level)
    except native.NativeBuildError as error:
        pytest.skip(f"the native kernel does not build here: {error}")


def mixed_plan(block_size: int) -> StepPlan:
    """A fresh prefill, a chunk continuing mid-prompt, and decodes whose contexts (1 to 70 tokens)
    end inside, exactly at and past block boundaries."""
    pool = BlockPool(NUM_BLOCKS, block_size=block_size)
    decodes = [Seq(f"d{n}", list(range(n)), num_computed=n - 1) for n in (1, 17, 16, 33, 70, 5)]
    seqs = [Seq("fresh", list(range(7))), *decodes[:3], Seq("chunk", list(range(30)), num_computed=9),
            *decodes[3:]]
    return make_plan(seqs, [7, 1, 1, 1, 6, 1, 1, 1], pool)


def prefill_plan(block_size: int) -> StepPlan:
    """Prefill chunks only: a fresh prompt over several blocks, chunks continuing a cached prefix from
    inside a block and from exactly a block boundary, and a two-token chunk ending a prompt."""
    pool = BlockPool(NUM_BLOCKS, block_size=block_size)
    seqs = [Seq("fresh", list(range(40))), Seq("mid", list(range(60)), num_computed=13),
            Seq("boundary", list(range(50)), num_computed=16), Seq("pair", list(range(9)), num_computed=7)]
    return make_plan(seqs, [40, 30, 20, 2], pool)


def run_step(backend: AttentionBackend, plan: StepPlan, block_size: int, dtype: torch.dtype,
             num_heads: int, num_kv_heads: int, head_dim: int,
             cache_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's attention over random caches (of cache_dtype; None: dtype); q, k, v are views of
    one qkv row as the model's."""
    meta = build_step_batch(plan, block_size, NUM_BLOCKS, backend).attn
    generator = torch.Generator().manual_seed(0)
    num_slots, num_tokens = NUM_BLOCKS * block_size, len(plan.input_ids)
    k_cache, v_cache = (torch.randn(num_kv_heads, num_slots, head_dim, generator=generator).to(cache_dtype or dtype)
                        for _ in range(2))
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=generator).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    out = backend.forward(q, k, v, k_cache, v_cache, meta)
    return out, torch.stack([k_cache, v_cache])
