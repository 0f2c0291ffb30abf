"""Scheduling policies: which sequences compute how many tokens this step.

One rule for both: a member gets its remaining tokens (num_tokens - num_computed_tokens) within
the step's token budget, which covers decode (1 token), chunked prefill, prefix-cache hits and
recompute after preemption alike. The policies differ only in who may hold a seat.
"""

from __future__ import annotations

from proto.config import EngineConfig
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.queues import RequestQueues
from scheduler_proc.request import Request, RequestStatus
from scheduler_proc.scheduled_batch import ScheduledBatch


def without_lone_query(num_remaining: int, budget: int, most: int) -> int:
    """Tokens for a member with num_remaining uncomputed ones, at most the budget left in this step
    and the `most` a step may give it, cut so that neither the chunk nor what it leaves for the next
    step is a single token where `most` >= 3; 0 = not this step. The attention kernel takes a
    member's only query in a step for a decode, whose last bits differ from the block path's: fp32
    logits would then depend on where a step's budget cut the prompt. Here they do not
    (tests/worker_proc/test_worker_batch_invariance.py)."""
    num_tokens = min(num_remaining, budget, most)
    if num_tokens == num_remaining or most < 3:
        return num_tokens
    if num_remaining - num_tokens == 1:
        num_tokens -= 1  # two left for the next step
    return num_tokens if num_tokens >= 2 else 0


def start_member(request: Request, prefix: list[int], num_tokens: int, batch: ScheduledBatch,
                 block_manager: BlockManager) -> bool:
    """Give a sequence that holds no blocks its computed `prefix` (see computed_prefix) and
    blocks for its next `num_tokens` tokens, and add it to `batch`; False (nothing changed) when
    the blocks are not there."""
    num_cached_tokens = len(prefix) * block_manager.block_size
    if not block_manager.allocate(request, num_cached_tokens + num_tokens, prefix):
        return False
    newly_scheduled = request.start(num_cached_tokens, block_manager.record_lookup(request, len(prefix)))
    batch.add_first(request, num_cached_tokens, num_tokens, newly_scheduled)
    return True


class ContinuousPolicy:
    """Running sequences first (oldest admission first), then FCFS admission into free seats.

    When a running sequence cannot get a block, the most recently admitted running sequence is
    preempted (possibly itself); nothing new is admitted in a step that preempted.

    Fair prefill (long_prefill_token_threshold T > 0): a member with more than T tokens left to
    compute is a long prefill; it gets at most T tokens this step, and at most
    max_num_partial_prefills long prefills run per step. A long waiting prompt over that quota is
    skipped for this step, so shorter requests behind it are admitted; blocks are still strictly
    FCFS (nobody overtakes a request that waits for blocks).

    Solo steps: after a worker raised in a step, each of its members owes a step of its own
    (Request.solo_owed) and is scheduled alone until it samples a token; others are not
    admitted past a waiting one that owes it.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, queues: RequestQueues) -> None:
        self.config = config
        self.block_manager = block_manager
        self.queues = queues
        self.num_padded_seat_steps_total = 0  # always 0: continuous batches hold no padding
        self._num_long_prefills = 0  # in the step being scheduled
        self._solo_steps_owed = False  # set by owe_solo_steps; cleared once nobody owes one

    def owe_solo_steps(self) -> None:
        """A step failed: its members now owe solo steps (the engine marked them)."""
        self._solo_steps_owed = True

    def schedule(self) -> ScheduledBatch:
        if self._solo_steps_owed:
            solo = self._solo_step()
            if solo is not None:
                return solo
        batch = ScheduledBatch()
        budget, block_size = self.config.max_num_batched_tokens, self.block_manager.block_size
        self._num_long_prefills = 0
        num_preemptions = self.queues.num_preemptions_total
        for request in list(self.queues.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_computed = request.num_computed_tokens
            if request.num_tokens - num_computed == 1 and num_computed < len(request.block_ids) * block_size:
                batch.add_decode(request)  # the common case, with nothing to decide
                budget -= 1
                continue
            num_tokens = self._chunk_size(request.num_tokens - num_computed, budget)
            if num_tokens and self._allocate_or_preempt(request, num_computed + num_tokens):
                batch.add(request, num_computed, num_tokens)
                budget -= num_tokens
        if self.queues.num_preemptions_total == num_preemptions:
            self._admit(batch, budget)
        return batch

    def drop_batch(self) -> None:
        """The workers were lost: nothing to give back (the engine requeued every running one)."""

    def _solo_step(self) -> ScheduledBatch | None:
        """The step of the running sequence that owes a solo step (a recompute may take several
        chunks), else of the head of waiting if it owes one and gets a seat and its blocks; None:
        schedule as usual (_admit stops at a waiting sequence that owes one, so blocks free up)."""
        queues, block_manager, budget = self.queues, self.block_manager, self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        owing = next((request for request in queues.running if request.solo_owed), None)
        if owing is not None:
            num_computed = owing.num_computed_tokens
            num_tokens = without_lone_query(owing.num_tokens - num_computed, budget, budget)
            if self._allocate_or_preempt(owing, num_computed + num_tokens):
                batch.add(owing, num_computed, num_tokens)
                return batch
        head = next((request for request in queues.waiting if request.solo_owed), None)
        if head is None:  # nobody owes one any more (a preempted owing one would be waiting)
            self._solo_steps_owed = False
            return None
        if head is not queues.waiting[0] or len(queues.running) >= self.config.max_num_seqs:
            return None
        prefix = block_manager.computed_prefix(head)
        # Blocks for its whole recompute, not just a chunk: the others do not run (nor free blocks)
        # while it runs alone, and a later chunk short of blocks would preempt it (the newest) to
        # start over, for ever. Until they are free the others run and drain.
        if not block_manager.can_allocate(head, head.num_tokens, prefix):
            return None
        num_remaining = head.num_tokens - len(prefix) * block_manager.block_size
        num_tokens = without_lone_query(num_remaining, budget, budget)
        if not start_member(head, prefix, num_tokens, batch, block_manager):
            return None
        queues.admit(0)
        return batch

    def release(self, request: Request) -> None:
        """A running sequence finished: free its seat and blocks at once."""
        self.queues.remove_running(request)
        self.block_manager.free(request)

    def _chunk_size(self, num_remaining: int, budget: int) -> int:
        """Tokens for a member with `num_remaining` uncomputed tokens; 0 = not this step."""
        threshold = self.config.long_prefill_token_threshold
        is_long = threshold != 0 and num_remaining > threshold
        if is_long and self._num_long_prefills >= self.config.max_num_partial_prefills:
            return 0
        most = min(threshold, self.config.max_num_batched_tokens) if is_long else self.config.max_num_batched_tokens
        num_tokens = without_lone_query(num_remaining, budget, most)
        if is_long and num_tokens:
            self._num_long_prefills += 1
        return num_tokens

    def _allocate_or_preempt(self, request: Request, num_tokens: int) -> bool:
        # Victims come from the end of the running list, so none of them is already in the batch.
        while not self.block_manager.allocate(request, num_tokens):
            if self.queues.preempt_newest(self.block_manager) is request:
                return False
        return True

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        queues, block_manager = self.queues, self.block_manager
        index = 0
        while index < len(queues.waiting) and budget > 0 and len(queues.running) < self.config.max_num_seqs:
            request = queues.waiting[index]
            if request.solo_owed:
                break  # it is admitted alone (_solo_step)
            prefix = block_manager.computed_prefix(request)
            num_remaining = request.num_tokens - len(prefix) * block_manager.block_size
            num_tokens = self._chunk_size(num_remaining, budget)
            if num_tokens == 0:
                index += 1  # a long prompt over this step's quota: shorter ones behind it may go
                continue
            if not start_member(request, prefix, num_tokens, batch, block_manager):
                break  # FCFS: nobody overtakes a request that waits for blocks
            queues.admit(index)
            budget -= num_tokens


class StaticPolicy:
    """For comparison only: a batch forms when nothing runs and runs until its last member ends.

    Finished members keep their seat, their blocks and their compute, as rows of a padded
    `model.generate` batch do (see ScheduledBatch.add_padding). Members reserve KV for their
    whole possible length at formation, so a static batch never preempts.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, queues: RequestQueues) -> None:
        self.config = config
        self.block_manager = block_manager
        self.queues = queues
        self.seats: list[Request] = []  # the batch in seat order, finished members included
        self.num_padded_seat_steps_total = 0  # sum over steps of seats held by finished members

    def schedule(self) -> ScheduledBatch:
        if not self.seats:
            self._form_batch()
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        for request in self.queues.running:  # live members first: padding must never starve them
            if budget == 0:
                break
            budget -= self._schedule_member(request, budget, batch)
        for request in self.seats:
            if not request.is_finished:
                continue
            self.num_padded_seat_steps_total += 1
            if budget > 0 and request.num_computed_tokens > 0:  # a seat that never computed has no KV
                batch.add_padding(request)
                budget -= 1
        return batch

    def drop_batch(self) -> None:
        """The workers were lost: finished members give back their seats and blocks (live ones
        were requeued by the engine)."""
        for seat in self.seats:
            if seat.is_finished:
                self.block_manager.free(seat)
        self.seats.clear()

    def owe_solo_steps(self) -> None:
        """Static batches are never split (comparison only): an input that makes the worker raise
        ends after the engine's MAX_FAILED_STEPS."""

    def release(self, request: Request) -> None:
        """A member finished: it keeps its seat and blocks until the whole batch has finished."""
        self.queues.remove_running(request)
        if not self.queues.running:
            for seat in self.seats:
                self.block_manager.free(seat)
            self.seats.clear()

    def _schedule_member(self, request: Request, budget: int, batch: ScheduledBatch) -> int:
        block_manager = self.block_manager
        if len(request.block_ids) == 0:  # its first step in this batch
            prefix = block_manager.computed_prefix(request)
            num_tokens = min(request.num_tokens - len(prefix) * block_manager.block_size, budget)
            ok = start_member(request, prefix, num_tokens, batch, block_manager)
        else:
            num_computed = request.num_computed_tokens
            num_tokens = min(request.num_tokens - num_computed, budget)
            ok = block_manager.allocate(request, num_computed + num_tokens)
            if ok:
                batch.add(request, num_computed, num_tokens)
        assert ok, f"static batch ran out of its reserved KV blocks at {request}"
        return num_tokens

    def _form_batch(self) -> None:
        queues = self.queues
        reserved_blocks = 0
        while queues.waiting and len(self.seats) < self.config.max_num_seqs:
            needed = self.block_manager.blocks_for_tokens(queues.waiting[0].max_num_kv_tokens)
            if reserved_blocks + needed > self.block_manager.num_blocks:
                break
            reserved_blocks += needed
            self.seats.append(queues.admit(0))


def make_policy(config: EngineConfig, block_manager: BlockManager,
                queues: RequestQueues) -> ContinuousPolicy | StaticPolicy:
    policy_class = StaticPolicy if config.scheduling == "static" else ContinuousPolicy
    return policy_class(config, block_manager, queues)
