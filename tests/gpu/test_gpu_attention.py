"""On CUDA: the flash-attn varlen backend and the torch reference agree on a mixed ragged step."""

from __future__ import annotations

import pytest
import torch
from test_worker_attention_varlen import (HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, caches_in_layout,
                                         mixed_plan)

from worker_proc.attention import attention_backend_for, to_device
from worker_proc.attention.flash import VarlenPagedAttention, load_flash_kernel
from worker_proc.attention.reference import TorchPagedAttention
from worker_proc.batch import build_step_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_flash = pytest.mark.skipif(load_flash_kernel() is None, reason="flash-attn is not installed")
CUDA = torch.device("cuda", 0)


def run_step(attention: object, block_size: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """One mixed step (fresh prefill, continuing chunk, two decodes) on random data."""
    plan = mixed_plan(block_size)
    generator = torch.Generator().manual_seed(0)
    num_tokens, num_slots = len(plan.input_ids), 16 * block_size
    caches = [torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2)]
    caches = caches_in_layout(attention, caches)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    q, k, v, *caches = (t.to(device, dtype) for t in (q, k, v, *caches))
    meta = to_device(build_step_batch(plan, block_size, 16, attention).attn, device)
    return attention.forward(q, k, v, caches[0], caches[1], meta).float().cpu()


def test_reference_attention_on_cuda_matches_the_cpu_in_fp32() -> None:
    want = run_step(TorchPagedAttention(), 4, torch.float32, torch.device("cpu"))
    got = run_step(TorchPagedAttention(), 4, torch.float32, CUDA)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_flash
@pytest.mark.parametrize("block_size", [16, 256])  # gathered blocks / flash-attn's own block table
def test_flash_varlen_backend_matches_the_reference_in_bf16(block_size: int) -> None:
    want = run_step(TorchPagedAttention(), block_size, torch.bfloat16, CUDA)
    got = run_step(VarlenPagedAttention(load_flash_kernel(), block_size), block_size, torch.bfloat16, CUDA)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@needs_flash
def test_bf16_on_cuda_selects_the_flash_backend() -> None:
    assert isinstance(attention_backend_for(CUDA, torch.bfloat16, 16), VarlenPagedAttention)
    assert isinstance(attention_backend_for(CUDA, torch.float32, 16), TorchPagedAttention)
