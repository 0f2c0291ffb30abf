"""Paged KV block accounting per sequence, with prefix caching: the worker owns the tensors.

A sequence's block table maps its token positions to KV blocks. Full blocks whose KV has been
computed are published in the prefix cache (BlockPool) under a key chained from the first block,
so another sequence with the same leading tokens takes them instead of recomputing them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scheduler_proc.block_pool import BlockPool
from scheduler_proc.request import Request, RequestStatus


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """How many blocks of block_size tokens hold num_tokens (rounded up)."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out KV blocks to sequences and takes them back; blocks are reference counted and
    shared (prefix-cache hits, sibling choices), and only full, computed blocks are ever shared,
    so no sequence writes a block another one reads.

    Invariant (check_invariants): each block's reference count equals the number of tables that
    hold it; a block held by no table is free (possibly cached); the pool's own invariants hold.
    Ownership: it decides which blocks a sequence holds and which are cached; the sequence's
    table itself is written through Request.add_blocks / mark_blocks_cached / drop_blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_cache_queries_total = 0  # tokens looked up at admission
        self.prefix_cache_hits_total = 0  # of those, tokens found
        self._holders: dict[tuple[str, int], Request] = {}  # sequences holding at least one block

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached ones included (they are reclaimable)."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def computed_prefix(self, request: Request) -> list[int]:
        """Blocks holding the KV of `request`'s leading full blocks, for a sequence with no blocks.

        With prefix caching: the longest chain of its block keys found in the cache. Without it:
        a sibling choice forks choice 0's computed prompt blocks. Either way at least one token
        is left to compute, so the step that finishes the prefill has logits to sample from; and
        two where a prompt that has sampled nothing yet has more than one: its last token alone
        would be attended as a decode, in other last bits than the block path gives it when the
        prompt runs whole, so the logits would depend on what the cache held (policy.
        without_lone_query). A resumed sequence's last token is one it sampled, a decode before.
        """
        assert len(request.block_ids) == 0, f"{request} already holds blocks"
        num_left = 2 if request.num_tokens == request.num_prompt_tokens else 1
        max_blocks = max(request.num_tokens - num_left, 0) // self.block_size
        if self.enable_prefix_caching:
            if not request.may_read_prefix_cache or max_blocks == 0:
                return []
            block_ids = []
            for key in request.compute_block_keys(max_blocks, self.block_size)[:max_blocks]:
                block_id = self.pool.lookup(key)
                if block_id is None:
                    break
                block_ids.append(block_id)
            return block_ids
        leader = request.leader
        if leader is None or leader.status is not RequestStatus.RUNNING:
            return []
        num_computed_prompt = min(leader.num_computed_tokens, leader.num_prompt_tokens)
        num_shared = min(max_blocks, num_computed_prompt // self.block_size)
        return leader.block_ids[:num_shared].tolist()

    def can_allocate(self, request: Request, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Whether allocate(request, num_tokens, prefix) would succeed now (nothing changes)."""
        num_new = max(self.blocks_for_tokens(num_tokens) - len(request.block_ids) - len(prefix), 0)
        num_revived = sum(self.pool.ref_count(block_id) == 0 for block_id in prefix)
        return num_new + num_revived <= self.pool.num_free

    def allocate(self, request: Request, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Grow the table to hold `num_tokens` tokens in total, first taking the shared `prefix`
        blocks (from computed_prefix, only for an empty table); all or nothing."""
        num_new = self.blocks_for_tokens(num_tokens) - len(request.block_ids) - len(prefix)
        if not prefix:
            if num_new <= 0:
                return True
            if num_new > self.pool.num_free:
                return False
            last = int(request.block_ids[-1]) if len(request.block_ids) else None
            request.add_blocks(self.pool.take(num_new, after=last))
        else:
            num_revived = sum(self.pool.ref_count(block_id) == 0 for block_id in prefix)
            if max(num_new, 0) + num_revived > self.pool.num_free:
                return False
            self.pool.share(list(prefix))
            new_blocks = self.pool.take(num_new) if num_new > 0 else []
            request.add_blocks([*prefix, *new_blocks], len(prefix) if self.enable_prefix_caching else None)
        self._holders[request.key] = request
        return True

    def record_lookup(self, request: Request, num_prefix_blocks: int) -> int:
        """Count an admitted sequence's cache lookup (in tokens); the tokens it found."""
        if not self.enable_prefix_caching:
            return 0
        num_hit_tokens = num_prefix_blocks * self.block_size
        if request.may_read_prefix_cache:
            self.prefix_cache_queries_total += request.num_tokens
            self.prefix_cache_hits_total += num_hit_tokens
        return num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the blocks that became full and computed (prompt or generated tokens)."""
        num_full = request.num_computed_tokens // self.block_size
        start = request.num_cached_blocks
        if not self.enable_prefix_caching or num_full <= start:
            return
        keys = request.compute_block_keys(num_full, self.block_size)
        for block_id, key in zip(request.block_ids[start:num_full].tolist(), keys[start:num_full]):
            self.pool.cache(block_id, key)
        request.mark_blocks_cached(num_full)

    def free(self, request: Request) -> None:
        """Drop `request`'s references (a no-op if it holds none). Tail blocks are released first:
        the end of a sequence is the least likely prefix for a later request, so it goes first."""
        if len(request.block_ids) == 0:
            return
        self.pool.release(request.drop_blocks()[::-1].tolist())
        del self._holders[request.key]

    def forget_cached_blocks(self) -> None:
        """Drop every prefix-cache entry (the workers' cache was lost); no block may be held."""
        assert not self._holders, f"{len(self._holders)} sequences still hold blocks"
        self.pool = BlockPool(self.num_blocks)

    def check_invariants(self) -> None:
        """Raise AssertionError if a reference count, the cache map or the free queue is off."""
        self.pool.check_invariants()
        counts = np.zeros(self.num_blocks, dtype=np.int64)  # int64 [num_blocks]
        for key, request in self._holders.items():
            table = request.block_ids
            assert request.key == key and len(table) > 0, f"{key} is listed as a holder without blocks"
            assert request.status in (RequestStatus.RUNNING, RequestStatus.FINISHED), (
                f"{request.status.value} {request.label} holds blocks")
            assert len(np.unique(table)) == len(table), f"{request.label} holds a block twice"
            np.add.at(counts, table, 1)
            capacity = len(table) * self.block_size
            assert request.num_computed_tokens <= capacity, (
                f"{request.label} has {request.num_computed_tokens} computed tokens in {capacity} slots")
            assert request.num_cached_blocks * self.block_size <= request.num_computed_tokens
            for index, block_id in enumerate(table.tolist()):
                cached_key = self.pool.key_of(block_id)  # a cached block must hold exactly this prefix
                assert cached_key is None or (index < request.num_cached_blocks
                                              and cached_key == request.block_keys[index]), (
                    f"{request.label} block {index} ({block_id}) is cached under another prefix")
        refs = np.array([self.pool.ref_count(b) for b in range(self.num_blocks)], dtype=np.int64)
        bad = np.flatnonzero(refs != counts)
        assert len(bad) == 0, f"block {bad[:5].tolist()} ref counts {refs[bad[:5]].tolist()} != holders"
