"""The waiting queue and the running set, and the moves between them (admit, preempt, remove)."""

from __future__ import annotations

from collections import deque

from scheduler_proc.block_manager import BlockManager
from scheduler_proc.request import Request, RequestStatus


class RequestQueues:
    """Waiting requests in FCFS order (preempted ones re-enter at the head) and running requests
    in admission order (so the last one is the most recently admitted: the preemption victim)."""

    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self._num_admissions = 0

    def admit_head(self) -> Request:
        request = self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        request.admission_order = self._num_admissions
        self._num_admissions += 1
        self.running.append(request)
        return request

    def preempt_newest(self, block_manager: BlockManager) -> Request:
        """Free the most recently admitted running request's blocks and requeue it at the head
        of waiting; it recomputes prompt + generated tokens when it is admitted again."""
        victim = self.running.pop()
        block_manager.free(victim)
        victim.preempt()
        self.waiting.appendleft(victim)
        self.num_preemptions_total += 1
        return victim

    def check_invariants(self, max_num_seqs: int) -> None:
        assert all(r.status is RequestStatus.WAITING for r in self.waiting)
        assert all(r.status is RequestStatus.RUNNING for r in self.running)
        assert all(len(r.block_ids) == 0 and r.num_computed_tokens == 0 for r in self.waiting), (
            "a waiting request kept blocks or progress")
        orders = [r.admission_order for r in self.running]
        assert orders == sorted(orders), "running set is not in admission order"
        assert len(self.running) <= max_num_seqs, f"{len(self.running)} running > {max_num_seqs} seats"
        ids = [r.request_id for r in self.waiting] + [r.request_id for r in self.running]
        assert len(ids) == len(set(ids)), "a request is queued twice"
