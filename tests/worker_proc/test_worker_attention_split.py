"""A decode over more than split_positions positions is attended by the native kernel in parts that
the threads share, then merged: it equals the reference at every ISA level, and its output depends
on its own context alone, not on the thread count or on the step's other queries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention_steps import LEVELS, NUM_BLOCKS, load, mixed_plan, run_step

from worker_proc.attention import native_kernel as native
from worker_proc.attention.native import NativePagedAttention
from worker_proc.attention.reference import TorchPagedAttention

# q's dtype, the caches', and the tolerance against the reference
DTYPES = [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 3e-2),
          (torch.float32, torch.bfloat16, 1e-5)]
CONTEXTS = (1, 15, 16, 17, 31, 33, 64, 65, 70, 150)  # one decode each, as a step's lone queries


@pytest.fixture(scope="module", params=LEVELS, ids=[level or "native" for level in LEVELS])
def leveled(request: pytest.FixtureRequest) -> native.PagedAttentionKernel:
    return load(request.param)


def decodes(contexts: tuple[int, ...], block_size: int, q_dtype: torch.dtype, cache_dtype: torch.dtype,
            shape: tuple[int, int, int] = (6, 2, 64)) -> tuple[torch.Tensor, ...]:
    """q [len(contexts), heads, head_dim], caches [kv_heads, NUM_BLOCKS * block_size, head_dim], block
    tables int32 [members, max_blocks] over shuffled blocks, token members and context lengths."""
    generator = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim = shape
    max_blocks = -(-max(contexts) // block_size)
    tables = torch.randperm(NUM_BLOCKS * 8, generator=generator, dtype=torch.int32)[:len(contexts) * max_blocks]
    tables = (tables % NUM_BLOCKS).view(len(contexts), max_blocks).contiguous()  # members may share blocks
    k_cache, v_cache = (torch.randn(num_kv_heads, NUM_BLOCKS * block_size, head_dim, generator=generator)
                        .to(cache_dtype) for _ in range(2))
    q = torch.randn(len(contexts), num_heads, head_dim, generator=generator).to(q_dtype)
    members = torch.arange(len(contexts), dtype=torch.int32)
    return q, k_cache, v_cache, tables, members, torch.tensor(contexts, dtype=torch.int32)


def attend(kernel: native.PagedAttentionKernel, inputs: tuple[torch.Tensor, ...], block_size: int,
           num_threads: int, split_positions: int) -> torch.Tensor:
    q, k_cache, v_cache, tables, members, contexts = inputs
    out = torch.empty_like(q)
    kernel(q, out, k_cache, v_cache, tables, members, contexts, block_size, num_threads, split_positions)
    return out


@pytest.mark.parametrize("q_dtype, cache_dtype, tolerance", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [
    (6, 2, 64), (8, 1, 128), (4, 2, 16),  # vector paths (AVX512 covers only some of each dtype)
    (6, 2, 24)])  # the portable loop
@pytest.mark.parametrize("split_positions", [16, 32])
def test_decodes_attended_in_parts_equal_the_reference_at_every_isa_level(
        leveled: native.PagedAttentionKernel, split_positions: int, num_heads: int, num_kv_heads: int,
        head_dim: int, q_dtype: torch.dtype, cache_dtype: torch.dtype, tolerance: float) -> None:
    """mixed_plan's decodes see up to 70 positions: up to 5 parts of 16, 3 of 32, the last shorter."""
    shape = (mixed_plan(4), 4, q_dtype, num_heads, num_kv_heads, head_dim, cache_dtype)
    want, _ = run_step(TorchPagedAttention(), *shape)
    backend = NativePagedAttention(leveled, 4, mixed_dtypes=q_dtype != cache_dtype, split_positions=split_positions)
    got, _ = run_step(backend, *shape)
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("q_dtype, cache_dtype", [dtypes[:2] for dtypes in DTYPES])
def test_a_decode_in_parts_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count(
        leveled: native.PagedAttentionKernel, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    inputs = decodes(CONTEXTS, 16, q_dtype, cache_dtype)
    batch = attend(leveled, inputs, 16, 2, 32)
    for num_threads in (1, 3):
        assert torch.equal(attend(leveled, inputs, 16, num_threads, 32), batch)
    q, k_cache, v_cache, tables, _, contexts = inputs
    for row in range(len(CONTEXTS)):
        alone = (q[row:row + 1], k_cache, v_cache, tables[row:row + 1], torch.zeros(1, dtype=torch.int32),
                 contexts[row:row + 1])
        assert torch.equal(attend(leveled, alone, 16, 2, 32)[0], batch[row])


def test_only_decodes_over_split_positions_are_split(leveled: native.PagedAttentionKernel) -> None:
    """Decodes of at most 32 positions take the one-part path bit for bit; longer ones are merged from
    parts, whose sums round differently (fp32: any of their thousands of outputs would show it)."""
    inputs = decodes(CONTEXTS, 16, torch.float32, torch.float32)
    whole, parts = attend(leveled, inputs, 16, 2, 0), attend(leveled, inputs, 16, 2, 32)
    short = torch.tensor(CONTEXTS) <= 32
    assert torch.equal(parts[short], whole[short])
    assert all(not torch.equal(parts[row], whole[row]) for row in torch.nonzero(~short).flatten().tolist())
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split_positions", [-16, 24])
def test_split_positions_off_the_tile_are_refused_naming_the_value(split_positions: int) -> None:
    kernel = load()
    inputs = decodes(CONTEXTS, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=f"split_positions {split_positions} \\(0 or a multiple of 16\\)"):
        attend(kernel, inputs, 16, 2, split_positions)


def test_a_prompt_chunks_queries_are_never_split(leveled: native.PagedAttentionKernel) -> None:
    """Three members' consecutive queries (chunks of 3, 2 and 1 tokens at up to 150 positions): only
    the last member, alone in the step, is a decode that parts change in its last bits."""
    q, k_cache, v_cache, tables, _, _ = decodes((150, 150, 150, 150, 150, 150), 16, torch.float32, torch.float32)
    members = torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.int32)
    contexts = torch.tensor([148, 149, 150, 149, 150, 150], dtype=torch.int32)
    inputs = (q, k_cache, v_cache, tables, members, contexts)
    whole, parts = attend(leveled, inputs, 16, 2, 0), attend(leveled, inputs, 16, 2, 32)
    assert torch.equal(parts[:5], whole[:5]) and not torch.equal(parts[5], whole[5])


class _Function:
    """A C function as ctypes holds it: takes argtypes and restype, records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def __call__(self, *args: object) -> int:
        self.calls.append(args)
        return 0


class _OlderLibrary:
    """A build from before split_positions: its paged_attend takes one argument less."""

    def __init__(self) -> None:
        self.paged_attend, self.paged_attention_path, self.paged_attention_block_path = (_Function() for _ in range(3))


def test_a_build_from_before_split_positions_is_called_with_its_own_arguments() -> None:
    library = _OlderLibrary()
    kernel = native.PagedAttentionKernel(library, Path("older.so"), None)
    inputs = decodes((20,), 16, torch.float32, torch.float32)
    attend(kernel, inputs, 16, 2, 0)
    (call,) = library.paged_attend.calls
    assert len(call) == 20 and call[-3:-1] == (0, 2)  # ..., dtypes (fp32), num_threads, where
    with pytest.raises(ValueError, match="older.so predates split_positions; pass 0"):
        attend(kernel, inputs, 16, 2, 512)
