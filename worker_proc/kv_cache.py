"""The paged KV cache: per layer one K and one V tensor, laid out as the attention backend asks.

Two layouts, chosen by the backend (`AttentionBackend.kv_layout`):
- BLOCKS_MAJOR [num_blocks, block_size, num_kv_heads, head_dim]: flash-attn's paged layout, so the
  varlen backend can hand its block table to the kernel (attention.flash).
- HEADS_MAJOR [num_kv_heads, num_blocks, block_size, head_dim]: the torch reference's. One
  index_select over slots then yields contiguous [kv_heads, num_seqs, context, head_dim] for
  batched matmuls; from BLOCKS_MAJOR that needs a transposing copy, or a strided gather that is
  slower still. SmolLM2-135M bf16, 32 decodes of 300-1000 tokens, one thread: 3.9 ms of
  attention a layer, against 11.6 ms for fp32 SDPA over a BLOCKS_MAJOR cache.
Either way block ids index blocks as the scheduler allocates them, and the flat view the model
passes to attention addresses slots (block_id * block_size + offset) along `slot_dim`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from proto.config import EngineConfig
from worker_proc import parallel
from worker_proc.model_config import ModelConfig


class KVLayout(enum.Enum):
    BLOCKS_MAJOR = "blocks_major"
    HEADS_MAJOR = "heads_major"

    @property
    def slot_dim(self) -> int:
        """The dim that slots index in a flat view, and that blocks index in the block tensor."""
        return 0 if self is KVLayout.BLOCKS_MAJOR else 1

    def shape(self, slot_sizes: tuple[int, ...], num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """(num_blocks, block_size) gives a layer's block tensor, (num_slots,) its flat view."""
        dims = [num_kv_heads, head_dim]
        dims[self.slot_dim:self.slot_dim] = slot_sizes
        return tuple(dims)

    def slots_major(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat cache viewed as [num_slots, num_kv_heads, head_dim] whatever the layout (no copy)."""
        return flat if self is KVLayout.BLOCKS_MAJOR else flat.transpose(0, 1)


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype,
                       tp_size: int) -> int:
    """Bytes one block takes on one rank: K and V, every layer."""
    kv_heads = parallel.kv_heads_per_rank(model.num_kv_heads, tp_size)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * kv_heads * model.head_dim * element_bytes


def num_kv_blocks_for(config: EngineConfig, model: ModelConfig, dtype: torch.dtype,
                      gpu_budget_bytes: int | None = None) -> int:
    """`config.num_kv_blocks` when set, else as many blocks as the budget holds: on a GPU the
    measured gpu_budget_bytes (gpu_kv_budget_bytes), on the CPU kv_cache_memory_bytes."""
    if config.num_kv_blocks > 0:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.block_size, dtype, config.tensor_parallel_size)
    if gpu_budget_bytes is not None:
        budget, name, remedy = (gpu_budget_bytes, "the GPU memory left for the KV cache",
                                "raise --gpu-memory-utilization or pass --num-kv-blocks")
    else:
        budget, name, remedy = (config.kv_cache_memory_bytes, "--kv-cache-memory",
                                f"pass --kv-cache-memory {per_block} or more (a block per "
                                f"{config.block_size} tokens of context)")
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"{name} ({budget} bytes) holds no KV block (one block of "
                         f"{config.block_size} tokens needs {per_block} bytes): {remedy}")
    return num_blocks


@dataclass(frozen=True)
class GPUMemory:
    """One GPU's memory as measured right after the profile step (torch.cuda)."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free on the device (other processes included)
    peak_allocated_bytes: int  # this process's tensors at their peak: weights + activations
    reserved_bytes: int  # what torch's caching allocator holds now

    @classmethod
    def measure(cls) -> GPUMemory:
        free, total = torch.cuda.mem_get_info()
        return cls(total, free, torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved())


def gather_scratch_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype,
                         max_model_len: int) -> int:
    """The most a gathering attention backend's per-layer scratch takes: K and V of max_num_seqs
    members padded to max_model_len tokens, with the buffers' 1/4 growth headroom."""
    kv_heads = parallel.kv_heads_per_rank(model.num_kv_heads, config.tensor_parallel_size)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    tokens = config.max_num_seqs * max_model_len
    return 2 * tokens * kv_heads * model.head_dim * element_bytes * 5 // 4


def gpu_kv_budget_bytes(memory: GPUMemory, utilization: float, profiled_tokens: int,
                        scratch_bytes: int = 0) -> int:
    """Bytes left for the KV cache within `utilization` of the GPU: the share, less the profile
    step's peak (weights + activations of the largest step), the attention backend's gather
    scratch (gather_scratch_bytes; 0 when it reads the cache in place) and whatever is not
    torch's (the CUDA context, NCCL buffers, other processes). Raises ValueError saying what to
    change."""
    allowed = int(memory.total_bytes * utilization)
    not_torch = max(0, memory.total_bytes - memory.free_bytes - memory.reserved_bytes)
    used = memory.peak_allocated_bytes + scratch_bytes + not_torch
    if used >= allowed:
        gib = 1 << 30
        raise ValueError(
            f"--gpu-memory-utilization {utilization} allows {allowed / gib:.2f} GiB of the GPU's "
            f"{memory.total_bytes / gib:.2f} GiB, but the weights and a {profiled_tokens}-token step "
            f"({memory.peak_allocated_bytes / gib:.2f} GiB), the attention gather scratch "
            f"({scratch_bytes / gib:.2f} GiB) and memory outside torch ({not_torch / gib:.2f} GiB) "
            f"already take {used / gib:.2f} GiB: raise --gpu-memory-utilization, lower "
            f"--max-num-batched-tokens, --max-num-seqs or --max-model-len, or use more GPUs")
    return allowed - used


@dataclass(frozen=True)
class KVCache:
    """Owned by the worker; block ids index dim `layout.slot_dim` of every tensor, as the scheduler
    allocates them."""

    layout: KVLayout
    k_blocks: list[torch.Tensor]  # per layer layout.shape((num_blocks, block_size), kv_heads, head_dim)
    v_blocks: list[torch.Tensor]  # per layer, as k_blocks

    @property
    def num_blocks(self) -> int:
        return self.k_blocks[0].shape[self.layout.slot_dim]

    def flat_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) with blocks and offsets merged into one slot dim: slot-addressed."""
        dim = self.layout.slot_dim
        return [(k.flatten(dim, dim + 1), v.flatten(dim, dim + 1))
                for k, v in zip(self.k_blocks, self.v_blocks)]


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      tp_size: int, device: torch.device, layout: KVLayout) -> KVCache:
    kv_heads = parallel.kv_heads_per_rank(model.num_kv_heads, tp_size)
    shape = layout.shape((num_blocks, block_size), kv_heads, model.head_dim)
    # Zeros, not empty: a freshly allocated slot never holds NaN bit patterns.
    k_blocks = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    v_blocks = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    return KVCache(layout, k_blocks, v_blocks)
