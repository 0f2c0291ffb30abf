"""Paged KV block accounting: which request owns which KV block; the worker owns the tensors.

Prefix-caching seam (not built yet): free blocks leave the pool in the order they entered it,
so the pool is already an LRU eviction queue; blocks carry reference counts, so a cached full
block can later be shared by several tables. What is missing is the hash chain of full blocks,
a hash -> block map, and taking a cached block out of the middle of the pool on a hit.
"""

from __future__ import annotations

import numpy as np

from scheduler_proc.request import Request, RequestStatus


class FreeBlockPool:
    """FIFO of free block ids (a ring buffer): the least recently freed block is handed out first."""

    def __init__(self, num_blocks: int) -> None:
        self._ring = np.arange(num_blocks, dtype=np.int32)  # int32 [num_blocks]
        self._head = 0
        self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def pop(self, count: int) -> np.ndarray:
        assert count <= self._count, f"pool has {self._count} free blocks, asked for {count}"
        positions = np.arange(self._head, self._head + count)  # int64 [count]
        block_ids = np.take(self._ring, positions, mode="wrap")  # int32 [count]
        self._head = (self._head + count) % len(self._ring)
        self._count -= count
        return block_ids

    def push(self, block_ids: np.ndarray) -> None:
        tail = self._head + self._count
        np.put(self._ring, np.arange(tail, tail + len(block_ids)), block_ids, mode="wrap")
        self._count += len(block_ids)

    def block_ids(self) -> np.ndarray:
        positions = np.arange(self._head, self._head + self._count)
        return np.take(self._ring, positions, mode="wrap")  # int32 [num_free]


class BlockManager:
    """Hands out fixed-size KV blocks to requests and takes them back.

    Invariant (check_invariants): every block is either in the free pool with ref count 0, or
    in exactly one request's block table with ref count 1; free + held == num_blocks.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._pool = FreeBlockPool(num_blocks)
        self._ref_counts = np.zeros(num_blocks, dtype=np.int32)  # int32 [num_blocks]
        self._holders: dict[str, Request] = {}  # requests holding at least one block

    @property
    def num_free_blocks(self) -> int:
        return len(self._pool)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self._pool) / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_to_allocate(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` lacks to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(request.block_table))

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow request's block table to hold num_tokens tokens in total; all or nothing."""
        needed = self.num_blocks_to_allocate(request, num_tokens)
        if needed == 0:
            return True
        if needed > len(self._pool):
            return False
        block_ids = self._pool.pop(needed)
        self._ref_counts[block_ids] += 1
        request.block_table.extend(block_ids)
        self._holders[request.request_id] = request
        return True

    def free(self, request: Request) -> None:
        """Return all of request's blocks to the pool (a no-op if it holds none)."""
        block_ids = request.block_ids
        if len(block_ids) == 0:
            return
        self._ref_counts[block_ids] -= 1
        # Tail first: the end of a sequence is the least likely prefix for a later request to reuse.
        released = block_ids[::-1]
        self._pool.push(released[self._ref_counts[released] == 0])
        request.block_table.clear()
        del self._holders[request.request_id]

    def check_invariants(self) -> None:
        """Raise AssertionError if any block is lost, duplicated or owned twice."""
        free_ids = self._pool.block_ids()
        tables = [r.block_ids for r in self._holders.values()]
        held_ids = np.concatenate(tables) if tables else np.empty(0, dtype=np.int32)
        assert len(free_ids) + len(held_ids) == self.num_blocks, (
            f"{len(free_ids)} free + {len(held_ids)} held != {self.num_blocks} blocks")
        every = np.concatenate([free_ids, held_ids])
        assert bool(((every >= 0) & (every < self.num_blocks)).all()), "block id out of range"
        assert len(np.unique(every)) == self.num_blocks, "a block is free and held, or held twice"
        assert bool((self._ref_counts[free_ids] == 0).all()), "a free block has a reference"
        assert bool((self._ref_counts[held_ids] == 1).all()), "a held block's ref count is not 1"
        for request_id, request in self._holders.items():
            assert request.request_id == request_id and len(request.block_ids) > 0
            assert request.status is not RequestStatus.WAITING, f"waiting {request_id} holds blocks"
            capacity = len(request.block_ids) * self.block_size
            assert request.num_computed_tokens <= capacity, (
                f"{request_id} has {request.num_computed_tokens} computed tokens in {capacity} slots")
