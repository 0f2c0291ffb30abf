"""The KV block pool: reference counts, the LRU queue of free blocks and the prefix-cache map.

A full KV block is keyed by its parent block's hash and its own token ids, so a key names the
whole prefix up to the end of the block (a hash chain). The map compares whole keys on a hit
(dict equality), so equal hashes of different token ids never alias; what remains is a 64-bit
collision between two different *parent chains* followed by the same block of tokens.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

BlockKey = tuple[int, bytes]  # (hash of the parent block's key, this block's int32 token ids as bytes)
ROOT_PARENT_HASH = 0  # the "parent hash" of a sequence's first block


def extend_block_keys(keys: list[BlockKey], token_ids: np.ndarray, num_blocks: int, block_size: int) -> None:
    """Grow `keys` (a sequence's chain, first block first) to cover its first `num_blocks` full blocks.

    Keys depend only on token ids, so a sequence keeps them across preemption.
    """
    parent_hash = hash(keys[-1]) if keys else ROOT_PARENT_HASH
    for index in range(len(keys), num_blocks):
        key = (parent_hash, token_ids[index * block_size:(index + 1) * block_size].tobytes())
        keys.append(key)
        parent_hash = hash(key)


class BlockPool:
    """Owns every block's reference count and cache key; sequences' tables live in BlockManager.

    Invariant (check_invariants): a block is either free (ref count 0, in the free queue, with or
    without a key) or in use (ref count >= 1, not in the queue). The map holds exactly the blocks
    with a key, under that key. Free blocks without a key sit at the front of the queue and are
    handed out first; cached free blocks follow in least-recently-freed order, so a cached block
    is evicted (dropped from the map) only when no uncached free block is left, with one
    exception: a growing sequence takes the block right after its last one whenever that block is
    free (see take).

    Why block ids matter: the workers' caches are laid out by block id, and one KV head's rows of
    a block are a 4 KB run of memory (fp32, 16 positions, head_dim 64). A decode reads its K and V
    block by block, and from scattered 4 KB runs a core streams about half what it streams from
    one long run, so a sequence whose blocks are consecutive ids is read about twice as fast.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = next out
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self.num_evictions_total = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def key_of(self, block_id: int) -> BlockKey | None:
        return self._keys[block_id]

    def lookup(self, key: BlockKey) -> int | None:
        """The cached block holding exactly this prefix, free or in use; None on a miss."""
        return self._cached.get(key)

    def take(self, count: int, after: int | None = None) -> list[int]:
        """`count` free blocks, now with ref count 1; a cached one is evicted from the map first.

        With `after` (the last block of the sequence that grows), the free blocks right after it
        come first, as far as they run: the sequence's memory stays one run. The rest come from
        the front of the queue, in ascending id order, so blocks that were freed together (one
        finished sequence's) are handed out as the run they were.
        """
        assert count <= len(self._free), f"pool has {len(self._free)} free blocks, asked for {count}"
        continued = []
        if after is not None:
            block_id = after + 1
            while len(continued) < count and block_id < self.num_blocks and self._ref_counts[block_id] == 0:
                del self._free[block_id]
                continued.append(self._claim(block_id))
                block_id += 1
        from_queue = [self._claim(self._free.popitem(last=False)[0]) for _ in range(count - len(continued))]
        return continued + sorted(from_queue)

    def _claim(self, block_id: int) -> int:
        """A block just taken off the free queue: evicted from the map if cached, ref count 1."""
        key = self._keys[block_id]
        if key is not None:
            del self._cached[key]
            self._keys[block_id] = None
            self.num_evictions_total += 1
        self._ref_counts[block_id] = 1
        return block_id

    def share(self, block_ids: list[int]) -> None:
        """One more reference to each block; a free (cached) block leaves the free queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference each; blocks reaching 0 become free in the given order (the first
        one released is the first of them to be evicted) and keep their contents and key."""
        for block_id in block_ids:
            ref_count = self._ref_counts[block_id] - 1
            self._ref_counts[block_id] = ref_count
            if ref_count == 0:
                self._free[block_id] = None
                if self._keys[block_id] is None:  # nothing to reuse: hand it out before any cached block
                    self._free.move_to_end(block_id, last=False)

    def cache(self, block_id: int, key: BlockKey) -> bool:
        """Publish a full, computed block under `key`; False when another block already holds
        that prefix (two sequences computed it at once): this one then stays private."""
        assert self._ref_counts[block_id] > 0, f"block {block_id} is free; only a held block is cached"
        if key in self._cached or self._keys[block_id] is not None:
            return False
        self._cached[key] = block_id
        self._keys[block_id] = key
        return True

    def check_invariants(self) -> None:
        refs = np.asarray(self._ref_counts, dtype=np.int64)  # int64 [num_blocks]
        assert bool((refs >= 0).all()), "a negative reference count"
        free_ids = np.fromiter(self._free.keys(), np.int64, len(self._free))  # int64 [num_free]
        assert bool(((free_ids >= 0) & (free_ids < self.num_blocks)).all()), "free block id out of range"
        is_free = np.zeros(self.num_blocks, dtype=bool)
        is_free[free_ids] = True
        assert bool((is_free == (refs == 0)).all()), "free queue and zero reference counts differ"
        for key, block_id in self._cached.items():
            assert self._keys[block_id] == key, f"map points {key[0]} to block {block_id} holding another key"
        num_keyed = sum(key is not None for key in self._keys)
        assert num_keyed == len(self._cached), f"{num_keyed} blocks carry keys, {len(self._cached)} are mapped"
        seen_cached = False
        for block_id in self._free:  # uncached free blocks all come before the cached ones
            seen_cached = seen_cached or self._keys[block_id] is not None
            assert not seen_cached or self._keys[block_id] is not None, "uncached block behind a cached one"
