"""The paged KV cache: per layer K and V of [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proto.config import EngineConfig
from worker_proc import parallel
from worker_proc.model_config import ModelConfig


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
    """Owned by the worker; block ids index dim 0 of every tensor, as the scheduler allocates them."""

    k_blocks: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    v_blocks: list[torch.Tensor]  # per layer [num_blocks, block_size, num_kv_heads, head_dim]

    @property
    def num_blocks(self) -> int:
        return self.k_blocks[0].shape[0]

    def flat_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) as [num_blocks * block_size, num_kv_heads, head_dim]: slot-addressed."""
        return [(k.flatten(0, 1), v.flatten(0, 1)) for k, v in zip(self.k_blocks, self.v_blocks)]


def allocate_kv_cache(model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      tp_size: int, device: torch.device) -> KVCache:
    kv_heads = parallel.kv_heads_per_rank(model.num_kv_heads, tp_size)
    shape = (num_blocks, block_size, kv_heads, model.head_dim)
    # Zeros, not empty: a freshly allocated slot never holds NaN bit patterns.
    k_blocks = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    v_blocks = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    return KVCache(k_blocks, v_blocks)
