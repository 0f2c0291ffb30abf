"""The paged KV cache: per layer one K and one V tensor, laid out as the attention backend asks.

Two layouts, chosen by the backend (`AttentionBackend.kv_layout`):
- BLOCKS_MAJOR [num_blocks, block_size, num_kv_heads, head_dim]: flash-attn's paged layout, so the
  varlen backend can hand its block table to the kernel (attention_varlen).
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


def num_kv_blocks_for(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """`config.num_kv_blocks` when set, else as many blocks as kv_cache_memory_bytes holds."""
    if config.num_kv_blocks > 0:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.block_size, dtype, config.tensor_parallel_size)
    num_blocks = config.kv_cache_memory_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no KV block "
                         f"(one block of {config.block_size} tokens needs {per_block} bytes)")
    return num_blocks


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
