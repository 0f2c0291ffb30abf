"""The waiting queue and the running set, and the moves between them (admit, preempt, release held)."""

from __future__ import annotations

from collections import deque

from scheduler_proc.block_manager import BlockManager
from scheduler_proc.request import Request, RequestStatus


class RequestQueues:
    """Waiting sequences in FCFS order (preempted ones and released siblings re-enter at the head)
    and running sequences in admission order (so the last one is the most recently admitted: the
    preemption victim). Held siblings are in neither; their choice 0 lists them.

    `num_waiting_tokens` is the sum of `num_tokens` over `waiting` (what those sequences must
    compute before their next token; a waiting sequence holds no progress), kept as each one moves.
    Ownership: the queues decide where a sequence is; its status changes through its own
    transitions (Request.admit, preempt, release_siblings)."""

    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_held = 0
        self.num_waiting_tokens = 0
        self.num_preemptions_total = 0
        self._preempted: list[Request] = []  # victims not yet reported (take_preempted)
        self._num_admissions = 0

    def add(self, choices: list[Request]) -> None:
        """Queue choice 0; its siblings (if any) are held."""
        self.waiting.append(choices[0])
        self.num_waiting_tokens += choices[0].num_tokens
        self.num_held += len(choices) - 1

    def admit(self, index: int) -> Request:
        request = self.waiting[index]
        del self.waiting[index]
        self.num_waiting_tokens -= request.num_tokens
        request.admit(self._num_admissions)
        self._num_admissions += 1
        self.running.append(request)
        return request

    def preempt_newest(self, block_manager: BlockManager, counted: bool = True) -> Request:
        """Free the most recently admitted running sequence's blocks and requeue it at the head
        of waiting; it recomputes prompt + generated tokens (minus cache hits) when admitted again.
        counted: a preemption for lack of blocks (not a recovery after lost workers)."""
        victim = self.running.pop()
        block_manager.free(victim)
        victim.preempt()
        self.waiting.appendleft(victim)
        self.num_waiting_tokens += victim.num_tokens
        if counted:
            self.num_preemptions_total += 1
            self._preempted.append(victim)
        return victim

    def release_held(self, leader: Request) -> None:
        """Queue choice 0's held siblings at the head of waiting, in choice order."""
        siblings = leader.release_siblings()
        for sibling in reversed(siblings):
            self.waiting.appendleft(sibling)
            self.num_waiting_tokens += sibling.num_tokens
        self.num_held -= len(siblings)

    def take_preempted(self) -> list[Request]:
        """The sequences preempted for lack of blocks since the last call, in preemption order."""
        preempted, self._preempted = self._preempted, []
        return preempted

    def remove_running(self, request: Request) -> None:
        """Take a running sequence out of the running set (it finished)."""
        self.running.remove(request)

    def remove_waiting(self, request: Request) -> None:
        """Take a waiting sequence out of the queue (it finished before it was admitted)."""
        self.waiting.remove(request)
        self.num_waiting_tokens -= request.num_tokens

    def drop_held(self, sibling: Request) -> None:
        """Forget a held sibling that finished (aborted alone) before its choice 0 released it."""
        sibling.leader.drop_held_sibling(sibling)
        self.num_held -= 1

    def check_invariants(self, max_num_seqs: int) -> None:
        assert all(r.status is RequestStatus.WAITING for r in self.waiting)
        assert all(r.status is RequestStatus.RUNNING for r in self.running)
        assert all(len(r.block_ids) == 0 and r.num_computed_tokens == 0 for r in self.waiting), (
            "a waiting request kept blocks or progress")
        orders = [r.admission_order for r in self.running]
        assert orders == sorted(orders), "running set is not in admission order"
        assert len(self.running) <= max_num_seqs, f"{len(self.running)} running > {max_num_seqs} seats"
        assert self.num_waiting_tokens == sum(r.num_tokens for r in self.waiting), (
            f"num_waiting_tokens {self.num_waiting_tokens} differs from the waiting queue's")
        keys = [r.key for r in self.waiting] + [r.key for r in self.running]
        assert len(keys) == len(set(keys)), "a sequence is queued twice"
