"""Scheduling policies: which requests compute how many tokens this step.

One rule for both: a member gets its remaining tokens (num_tokens - num_computed_tokens) within
the step's token budget, which covers decode (1 token), chunked prefill and recompute after
preemption alike. The policies differ only in who may hold a seat.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.config import EngineConfig
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.queues import RequestQueues
from scheduler_proc.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """One batch member of a step: tokens [num_computed_tokens, +num_scheduled_tokens)."""

    request: Request
    num_computed_tokens: int
    num_scheduled_tokens: int
    sample: bool  # reaches the end of the known tokens, so the worker samples the next one
    is_padding: bool = False  # a finished request's seat in a static batch; result discarded


def schedule_member(request: Request, budget: int, block_manager: BlockManager) -> ScheduledSeq | None:
    """Give `request` up to `budget` of its remaining tokens with KV blocks for them; None if
    the blocks are not there (nothing is allocated then)."""
    start = request.num_computed_tokens
    num_tokens = min(request.num_remaining_tokens, budget)
    assert num_tokens > 0, f"{request} has nothing to compute"
    if not block_manager.allocate(request, start + num_tokens):
        return None
    return ScheduledSeq(request, start, num_tokens, sample=start + num_tokens == request.num_tokens)


class ContinuousPolicy:
    """Running requests first (oldest admission first), then FCFS admission into free seats.

    When a running request cannot get a block, the most recently admitted running request is
    preempted (possibly itself); nothing new is admitted in a step that preempted.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, queues: RequestQueues) -> None:
        self.config = config
        self.block_manager = block_manager
        self.queues = queues
        self.num_padded_seat_steps_total = 0  # always 0: continuous batches hold no padding

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        num_preemptions = self.queues.num_preemptions_total
        for request in list(self.queues.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            seq = self._schedule_or_preempt(request, budget)
            if seq is not None:
                seqs.append(seq)
                budget -= seq.num_scheduled_tokens
        if self.queues.num_preemptions_total == num_preemptions:
            self._admit(seqs, budget)
        return seqs

    def release(self, request: Request) -> None:
        """A running request finished: free its seat and blocks at once."""
        self.queues.running.remove(request)
        self.block_manager.free(request)

    def _schedule_or_preempt(self, request: Request, budget: int) -> ScheduledSeq | None:
        # Victims come from the end of the running list, so none of them is already in `seqs`.
        while True:
            seq = schedule_member(request, budget, self.block_manager)
            if seq is not None:
                return seq
            if self.queues.preempt_newest(self.block_manager) is request:
                return None

    def _admit(self, seqs: list[ScheduledSeq], budget: int) -> None:
        queues = self.queues
        while queues.waiting and budget > 0 and len(queues.running) < self.config.max_num_seqs:
            seq = schedule_member(queues.waiting[0], budget, self.block_manager)
            if seq is None:
                break  # FCFS: the head waits for blocks, nobody overtakes it
            queues.admit_head()
            seqs.append(seq)
            budget -= seq.num_scheduled_tokens


class StaticPolicy:
    """For comparison only: a batch forms when nothing runs and runs until its last member ends.

    Finished members keep their seat, their blocks and their compute, as rows of a padded
    `model.generate` batch do: each step re-feeds the seat's last computed token at its own
    position (same KV slot, same value) and the sampled token is discarded. Members reserve
    KV for their whole possible length at formation, so a static batch never preempts.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, queues: RequestQueues) -> None:
        self.config = config
        self.block_manager = block_manager
        self.queues = queues
        self.seats: list[Request] = []  # the batch in seat order, finished members included
        self.num_padded_seat_steps_total = 0  # sum over steps of seats held by finished members

    def schedule(self) -> list[ScheduledSeq]:
        if not self.seats:
            self._form_batch()
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        for request in self.queues.running:  # live members first: padding must never starve them
            if budget == 0:
                break
            seq = schedule_member(request, budget, self.block_manager)
            assert seq is not None, f"static batch ran out of its reserved KV blocks at {request}"
            seqs.append(seq)
            budget -= seq.num_scheduled_tokens
        for request in self.seats:
            if not request.is_finished:
                continue
            self.num_padded_seat_steps_total += 1
            if budget > 0 and request.num_computed_tokens > 0:  # a seat that never computed has no KV
                seqs.append(self._padding(request))
                budget -= 1
        return seqs

    def release(self, request: Request) -> None:
        """A member finished: it keeps its seat and blocks until the whole batch has finished."""
        self.queues.running.remove(request)
        if not self.queues.running:
            for seat in self.seats:
                self.block_manager.free(seat)
            self.seats.clear()

    def _form_batch(self) -> None:
        queues = self.queues
        reserved_blocks = 0
        while queues.waiting and len(self.seats) < self.config.max_num_seqs:
            needed = self.block_manager.blocks_for_tokens(queues.waiting[0].max_num_kv_tokens)
            if reserved_blocks + needed > self.block_manager.num_blocks:
                break
            reserved_blocks += needed
            self.seats.append(queues.admit_head())

    @staticmethod
    def _padding(request: Request) -> ScheduledSeq:
        position = request.num_computed_tokens - 1
        return ScheduledSeq(request, position, 1, sample=True, is_padding=True)


def make_policy(config: EngineConfig, block_manager: BlockManager,
                queues: RequestQueues) -> ContinuousPolicy | StaticPolicy:
    policy_class = StaticPolicy if config.scheduling == "static" else ContinuousPolicy
    return policy_class(config, block_manager, queues)
