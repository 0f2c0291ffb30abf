"""The varlen (flash-attn) backend's argument mapping equals the torch reference, checked on the
CPU with a plain-torch kernel that implements flash_attn_varlen_func's documented contract; with
that kernel standing in for an installed flash-attn, selection picks it exactly where it can run."""

from __future__ import annotations

import math

import pytest
import torch
from worker_plans import BlockPool, Seq, make_plan

from proto.messages import StepPlan
from worker_proc.attention import AttentionBackend, AttentionBackendError, attention_backend_for, flash
from worker_proc.attention.flash import VarlenPagedAttention
from worker_proc.attention.native import NativePagedAttention
from worker_proc.attention.reference import TorchPagedAttention
from worker_proc.batch import build_step_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def contract_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                    causal: bool, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """flash_attn_varlen_func as documented: GQA, bottom-right causal, optional paged K/V."""
    assert causal and int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) == max_seqlen_q
    assert int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) == max_seqlen_k
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[-2]
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1],
                                           cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        num_q, num_k = q1 - q0, k1 - k0
        if block_table is None:
            keys, values = k[k0:k1], v[k0:k1]
        else:
            keys = k[block_table[i].long()].flatten(0, 1)[:num_k]
            values = v[block_table[i].long()].flatten(0, 1)[:num_k]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], keys) / math.sqrt(q.shape[-1])
        visible = torch.arange(num_k)[None, :] <= torch.arange(num_q)[:, None] + (num_k - num_q)
        scores.masked_fill_(~visible, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def caches_in_layout(attention: AttentionBackend, caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of [num_slots, kv_heads, head_dim] caches, laid out as `attention` keeps its cache."""
    layout = attention.kv_layout
    copies = [torch.empty(layout.shape(c.shape[:1], *c.shape[1:]), dtype=c.dtype) for c in caches]
    for copy, cache in zip(copies, caches):
        layout.slots_major(copy).copy_(cache)
    return copies


def mixed_plan(block_size: int) -> StepPlan:
    """A fresh prefill, a chunk continuing mid-prompt, and two decodes of different lengths."""
    pool = BlockPool(16, block_size=block_size)
    seqs = [Seq("fresh", list(range(7))), Seq("chunk", list(range(20)), num_computed=5),
            Seq("long", list(range(10)), num_computed=9), Seq("short", [1, 2, 3, 4], num_computed=3)]
    return make_plan(seqs, [7, 6, 1, 1], pool)


@pytest.mark.parametrize("block_size", [4, 256])  # gathered context / the paged block table
def test_varlen_backend_matches_the_reference_on_a_mixed_step(block_size: int) -> None:
    backend = VarlenPagedAttention(contract_kernel, block_size)
    assert backend.paged == (block_size == 256)
    plan = mixed_plan(block_size)
    generator = torch.Generator().manual_seed(0)
    num_slots = 16 * block_size
    cache = [torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2)]
    num_tokens = len(plan.input_ids)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))

    def run(attention: AttentionBackend) -> tuple[torch.Tensor, list[torch.Tensor]]:
        meta = build_step_batch(plan, block_size, 16, attention).attn
        caches = caches_in_layout(attention, cache)
        out = attention.forward(q, k, v, caches[0], caches[1], meta)
        return out, [attention.kv_layout.slots_major(c) for c in caches]

    want, want_caches = run(TorchPagedAttention())
    got, got_caches = run(backend)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got_cache, want_cache in zip(got_caches, want_caches):
        assert torch.equal(got_cache, want_cache)  # this step's K/V written to the same slots


@pytest.fixture
def flash_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn importable, as the contract kernel (selection only looks at the device type)."""
    monkeypatch.setattr(flash, "load_flash_kernel", lambda: contract_kernel)


@pytest.mark.parametrize("block_size", [16, 256])
def test_auto_picks_installed_flash_on_cuda_in_half_precision(flash_installed: None, block_size: int) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        backend = attention_backend_for(torch.device("cuda"), dtype, block_size)
        assert isinstance(backend, VarlenPagedAttention) and backend.kernel is contract_kernel
        assert backend.paged == (block_size == 256)


def test_auto_never_picks_installed_flash_off_cuda_or_in_fp32(flash_installed: None) -> None:
    on_cpu = attention_backend_for(torch.device("cpu"), torch.bfloat16, 16)
    assert isinstance(on_cpu, (TorchPagedAttention, NativePagedAttention))
    assert type(attention_backend_for(torch.device("cuda"), torch.float32, 16)) is TorchPagedAttention


def test_auto_on_cuda_without_flash_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash, "load_flash_kernel", lambda: None)
    assert type(attention_backend_for(torch.device("cuda"), torch.bfloat16, 16)) is TorchPagedAttention


def test_explicit_flash_that_cannot_run_fails_with_the_reason_even_when_installed(
        flash_installed: None) -> None:
    with pytest.raises(AttentionBackendError, match="flash: needs a CUDA device, the worker runs on cpu"):
        attention_backend_for(torch.device("cpu"), torch.bfloat16, 16, "flash")
    with pytest.raises(AttentionBackendError,
                       match=r"flash: needs bfloat16 or float16, attention runs in torch.float32 \(the KV cache"):
        attention_backend_for(torch.device("cuda"), torch.float32, 16, "flash")
