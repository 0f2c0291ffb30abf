"""The scheduler's whole state in one object: live requests, queues, KV blocks and the step in flight."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proto.config import EngineConfig, free_seats
from proto.messages import (ALL_CHOICES, ERROR_NONE, EVENT_FIRST_TOKEN, EVENT_PREEMPTED, EVENT_QUEUED,
                            EVENT_SCHEDULED, AddRequest, FinishReason, SchedulerStats, StepOutputs,
                            StepPlan, StepResult)
from scheduler_proc.admission import rejection_reason
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.choices import make_choices
from scheduler_proc.constraints import Constraints
from scheduler_proc.logprobs import entries_error, forward_entries
from scheduler_proc.outputs import HEARTBEAT_STEP_ID, OutputBuffer, OutputOwner
from scheduler_proc.plan_builder import build_plan
from scheduler_proc.plan_constants import PlanConstants
from scheduler_proc.policy import make_policy
from scheduler_proc.queues import RequestQueues
from scheduler_proc.request import Request, RequestStatus
from scheduler_proc.scheduled_batch import ScheduledBatch
from scheduler_proc.stop import stop_reason

logger = logging.getLogger(__name__)

# A sequence in this many failed steps ends with "error" even if it never failed alone: a fault
# that only its batches raise must not restart the worker group until --max-restarts stops the server.
MAX_FAILED_STEPS = 3


class StepMismatchError(RuntimeError):
    """A StepResult that answers no plan in flight, or another step than the one in flight."""


@dataclass(frozen=True)
class _InFlightStep:
    step_id: int
    batch: ScheduledBatch
    num_sampled: int
    started_s: float  # time.perf_counter() when the plan was built


class SchedulerEngine:
    """Owns the live requests and the step in flight, and drives each request's lifecycle
    (waiting -> running -> finished; running -> waiting on preemption; held -> waiting for
    sibling choices) through the queues, the policy, the block manager and the Request's own
    transitions. Plain synchronous code: the loop feeds it messages.

    Invariant: every choice of every request added gets exactly one output with a non-empty
    finish reason (and a FINISHED event), after which the engine forgets it. Finished sequences
    release seat and blocks before the next schedule() (a static batch keeps finished seats
    until the batch ends, by design). Lifecycle events use the scheduler's wall clock.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int, rng: random.Random | None = None,
                 constraints: Constraints | None = None) -> None:
        self.config = config
        self.constraints = constraints or Constraints(config)
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.queues = RequestQueues()
        self.policy = make_policy(config, self.block_manager, self.queues)
        self.constants = PlanConstants()
        self._rng = rng or random.Random()
        self._requests: dict[str, list[Request]] = {}  # unfinished choices, by request id
        self._outputs = OutputBuffer()
        self._in_flight: _InFlightStep | None = None
        self._next_step_id = 0
        self.num_requests_recovered_total = 0
        self.scheduler_pid = 0  # stamped on every StepOutputs (the loop sets both)
        self.frontend_epoch = -1  # FrontendHello.epoch of the last hello read

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def in_flight_step_id(self) -> int | None:
        return None if self._in_flight is None else self._in_flight.step_id

    @property
    def num_padded_seat_steps_total(self) -> int:
        return self.policy.num_padded_seat_steps_total

    def get_request(self, request_id: str, choice_index: int = 0) -> Request | None:
        """The unfinished choice, or None."""
        for request in self._requests.get(request_id, ()):
            if request.choice_index == choice_index:
                return request
        return None

    def add(self, message: AddRequest, seats_open: bool = True) -> None:
        """Queue a new request's choices, or finish each at once with "error" if it can never run
        (or may not queue). `seats_open`: whether free seats take waiting sequences at the next
        step (not while no worker group serves)."""
        request_id, params, now = message.request_id, message.sampling_params, time.time()
        num_free_seats = free_seats(self.config, len(self.queues.running), seats_open)
        reason, error_code = rejection_reason(message, self.config, self.block_manager.num_blocks,
                                              len(self.queues.waiting) + self.queues.num_held,
                                              self.queues.num_waiting_tokens, num_free_seats)
        duplicate = request_id in self._requests
        if duplicate:
            logger.warning("duplicate request id %r rejected", request_id)
            reason, error_code = f"request id {request_id!r} is already in use", ERROR_NONE
        grammars: list = []
        if not reason and (message.grammar is not None or params.allowed_token_ids or params.bad_words_token_ids):
            grammars, reason = self.constraints.for_request(message)  # a grammar: the frontend compiled it first
        if reason:
            for choice_index in range(params.n):
                self._outputs.add(OutputOwner(request_id, choice_index, 0), -1, FinishReason.ERROR, reason, now,
                                  finished_event=not duplicate, error_code=error_code)
            return
        # A drawn seed is kept for the request's life, so recompute after preemption resamples
        # exactly the same tokens.
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        choices = make_choices(message, seed, self.config, grammars)
        for choice in choices:
            self.constants.assign(choice)
            self._outputs.add_event(request_id, choice.choice_index, EVENT_QUEUED, now)
        self._requests[request_id] = list(choices)
        self.queues.add(choices)

    def abort(self, request_ids: Sequence[str], choice_indices: Sequence[int] = ()) -> None:
        """Finish with reason "abort" choice choice_indices[i] of request request_ids[i], or every
        unfinished choice of it (ALL_CHOICES, or no choice_indices at all). Its blocks and seat are
        released now and it gets no more tokens; its siblings run on. Unknown ids and choices
        that finished already are ignored, since the frontend may abort after the final output."""
        now = time.time()
        if not len(choice_indices):
            choice_indices = [ALL_CHOICES] * len(request_ids)
        for request_id, choice_index in zip(request_ids, choice_indices):
            for request in list(self._requests.get(request_id, ())):
                if choice_index in (ALL_CHOICES, request.choice_index):
                    self._finish(request, FinishReason.ABORT, now=now)

    def abort_all(self) -> int:
        """Abort every unfinished request (their frontend is gone); how many requests that was."""
        request_ids = list(self._requests)
        self.abort(request_ids)
        return len(request_ids)

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to compute."""
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step_id} is still in flight")
        batch = self.policy.schedule()
        now = time.time()
        for request in batch.newly_scheduled:
            self._outputs.add_event(request.request_id, request.choice_index, EVENT_SCHEDULED, now)
        for victim in self.queues.take_preempted():
            self._outputs.add_event(victim.request_id, victim.choice_index, EVENT_PREEMPTED, now)
        if not batch:
            return None
        plan = build_plan(self._next_step_id, batch, self.constants, self.constraints)
        self._in_flight = _InFlightStep(self._next_step_id, batch, sum(batch.sample), time.perf_counter())
        self._next_step_id += 1
        return plan

    def apply_result(self, result: StepResult) -> StepOutputs:
        """Append sampled tokens, advance progress, publish full blocks in the prefix cache, run
        stop checks, forward logprobs and retire finished sequences."""
        step = self._in_flight
        if step is None or result.step_id != step.step_id:
            expected = "no step" if step is None else f"step {step.step_id}"
            raise StepMismatchError(f"got a result for step {result.step_id} while {expected} is in flight")
        self._in_flight = None
        now = time.time()
        error = result.error or self._result_error(result, step)
        if error:
            message = f"the worker failed step {step.step_id}: {error}"
            for request in step.batch.requests:
                if not request.is_finished:
                    self._finish(request, FinishReason.ERROR, message, now=now)
        else:
            self._advance(step.batch, result, now)
        return self._outputs.build(step.step_id, self.stats(), time.perf_counter() - step.started_s,
                                   step.batch.num_tokens)

    def fail_running(self, error_message: str) -> StepOutputs:
        """The step in flight is lost (e.g. a worker timed out): every running sequence fails."""
        step_id = HEARTBEAT_STEP_ID if self._in_flight is None else self._in_flight.step_id
        self._in_flight = None
        now = time.time()
        for request in list(self.queues.running):
            self._finish(request, FinishReason.ERROR, error_message, now=now)
        return self._outputs.build(step_id, self.stats(), 0.0)

    def recover_lost_step(self) -> StepOutputs:
        """The worker group lost its KV cache (a rank died or hung; a new group is starting): the
        step in flight is dropped and every running sequence goes back to the head of waiting in
        admission order, keeping its tokens, to be recomputed as after a preemption. No prefix-
        cached block survives: the new group's cache is empty."""
        step_id = HEARTBEAT_STEP_ID if self._in_flight is None else self._in_flight.step_id
        self._in_flight = None
        recovered = len(self.queues.running)
        while self.queues.running:
            self.queues.preempt_newest(self.block_manager, counted=False)
        self.policy.drop_batch()
        self.block_manager.forget_cached_blocks()
        self.num_requests_recovered_total += recovered
        return self._outputs.build(step_id, self.stats(), 0.0)

    def recover_failed_step(self, error: str) -> StepOutputs:
        """A rank raised in the step in flight, and the group is replaced as after a lost step.
        The input of a member may be what raises, and each replacement counts against
        --max-restarts: a member that failed again alone in its step, or in MAX_FAILED_STEPS
        steps, ends with "error"; the others are recovered (recover_lost_step) and owe a solo
        step (Request.solo_owed), where one that raises again is found alone."""
        step = self._in_flight
        assert step is not None, "a failed step with no step in flight"
        members = [request for request in step.batch.requests if not request.is_finished]
        alone, now = len(members) == 1, time.time()
        for request in members:
            num_failed = request.step_failed()
            if num_failed >= MAX_FAILED_STEPS or (alone and num_failed >= 2):
                where = ", the last one alone" if alone else ""
                self._finish(request, FinishReason.ERROR, f"the worker failed {num_failed} steps with this "
                             f"request in them{where}: {error}", now=now)
        self.policy.owe_solo_steps()
        return self.recover_lost_step()

    def finish_all(self, error_message: str) -> StepOutputs:
        """Fail every unfinished choice (shutdown): none may end without its terminal output."""
        self._in_flight = None
        now = time.time()
        for request in [choice for choices in self._requests.values() for choice in choices]:
            self._finish(request, FinishReason.ERROR, error_message, now=now)
        return self._outputs.build(HEARTBEAT_STEP_ID, self.stats(), 0.0)

    def drain_outputs(self) -> StepOutputs | None:
        """Outputs that belong to no step (rejections, aborts), or None if there are none;
        pending events alone wait for the next step's outputs or heartbeat."""
        if len(self._outputs) == 0:
            return None
        return self._outputs.build(HEARTBEAT_STEP_ID, self.stats(), 0.0)

    def heartbeat(self) -> StepOutputs:
        """Current stats (and any pending outputs and events) with step_id -1."""
        return self._outputs.build(HEARTBEAT_STEP_ID, self.stats(), 0.0)

    def progress_heartbeat(self, step_running_s: float, step_idle_s: float) -> StepOutputs:
        """Stats alone, step_id -1, while a step has run for step_running_s (its ranks idle for
        step_idle_s): pending events stay for the step's own outputs (a heartbeat that is not
        taken loses nothing)."""
        stats = dataclasses.replace(self.stats(), step_running_s=step_running_s, step_idle_s=step_idle_s)
        return StepOutputs(HEARTBEAT_STEP_ID, [], np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.int32),
                           [], [], stats)

    def stats(self) -> SchedulerStats:
        block_manager = self.block_manager
        return SchedulerStats(num_running=len(self.queues.running),
                              num_waiting=len(self.queues.waiting) + self.queues.num_held,
                              num_waiting_tokens=self.queues.num_waiting_tokens,
                              kv_cache_usage=block_manager.usage,
                              num_preemptions_total=self.queues.num_preemptions_total,
                              num_padded_slot_steps_total=self.policy.num_padded_seat_steps_total,
                              prefix_cache_queries_total=block_manager.prefix_cache_queries_total,
                              prefix_cache_hits_total=block_manager.prefix_cache_hits_total,
                              num_requests_recovered_total=self.num_requests_recovered_total,
                              scheduler_pid=self.scheduler_pid, frontend_epoch=self.frontend_epoch)

    def check_invariants(self) -> None:
        self.block_manager.check_invariants()
        self.queues.check_invariants(self.config.max_num_seqs)
        live = {r.key: r for choices in self._requests.values() for r in choices}
        queued = {r.key for r in self.queues.waiting} | {r.key for r in self.queues.running}
        held = {key for key, r in live.items() if r.status is RequestStatus.HELD}
        assert queued | held == set(live) and not queued & held, "live sequences and queued ones differ"
        assert len(held) == self.queues.num_held, f"{len(held)} held, queues count {self.queues.num_held}"
        assert self.constants.num_live == len(live), "plan rows and live sequences differ"
        for request in live.values():
            assert not request.is_finished and 0 <= request.num_computed_tokens <= request.num_tokens
            if request.status is RequestStatus.HELD:
                leader = request.leader
                assert leader is not None and request in leader.held_siblings and not leader.is_finished

    def _advance(self, batch: ScheduledBatch, result: StepResult, now: float) -> None:
        """Apply one successful step (the hot loop: keep it O(batch) and lean). Per member: count
        its progress and take its token (Request.advance), share what it computed, queue its
        output; then forward the step's logprobs."""
        with_logprobs, finished = len(result.logprobs) > 0, RequestStatus.FINISHED
        member_rows: list[int] = []  # per member: its output row (-1 = none), to re-index logprobs
        members = zip(batch.requests, batch.num_scheduled_tokens, batch.member_token_ids(result.sampled_token_ids))
        for request, num_scheduled, token_id in members:
            if request.status is finished:  # a static batch's finished seat, or aborted while the step ran
                member_rows.append(-1)
                continue
            request.advance(num_scheduled, token_id)
            self._share_computed(request)
            member_rows.append(self._emit(request, token_id, now, with_logprobs))
        if with_logprobs:
            rows = np.array(member_rows, dtype=np.int32)  # int32 [num_seqs]
            self._outputs.add_logprobs(forward_entries(result, batch.requests, rows, batch.prompt_logprob_rows))

    def _share_computed(self, request: Request) -> None:
        """Publish its newly full, computed blocks in the prefix cache, and queue its held
        siblings once the prompt they share is computed (and cached)."""
        num_computed, block_manager = request.num_computed_tokens, self.block_manager
        if (block_manager.enable_prefix_caching
                and num_computed >= (request.num_cached_blocks + 1) * block_manager.block_size):
            block_manager.cache_full_blocks(request)
        if request.held_siblings and num_computed >= request.num_prompt_tokens:
            self.queues.release_held(request)

    def _emit(self, request: Request, token_id: int, now: float, with_logprobs: bool) -> int:
        """Queue a running member's output row (-1 = none): its new token, or its terminal output
        when the stop rule ends it; a prefill chunk (token_id -1) has one only for prompt logprobs."""
        if token_id < 0:
            return self._outputs.add(request) if with_logprobs else -1
        if request.num_tokens == request.num_prompt_tokens + 1:
            self._outputs.add_event(request.request_id, request.choice_index, EVENT_FIRST_TOKEN, now)
        reason = stop_reason(request)
        if reason is FinishReason.ERROR:  # its grammar failed: the token it rejected is not output
            return self._finish(request, reason, request.grammar.error, now=now)
        if reason:
            return self._finish(request, reason, token_id=token_id, now=now)
        return self._outputs.add_token(request, token_id)

    def _result_error(self, result: StepResult, step: _InFlightStep) -> str:
        token_ids, num_sampled = result.sampled_token_ids, step.num_sampled
        if len(token_ids) != num_sampled:
            return f"it returned {len(token_ids)} sampled tokens for {num_sampled} sampling members"
        vocab_size = self.config.vocab_size
        if num_sampled and (int(token_ids.min()) < 0 or (vocab_size and int(token_ids.max()) >= vocab_size)):
            return f"it sampled token ids outside [0, {vocab_size}): {token_ids.min()}..{token_ids.max()}"
        return entries_error(result, len(step.batch))

    def _finish(self, request: Request, reason: FinishReason, error_message: str = "", token_id: int = -1,
                now: float = 0.0) -> int:
        """Give the sequence its one terminal output and release its seat and blocks now; its
        held siblings (if it is choice 0 and still holds them) are queued. The output's row."""
        status = request.status
        request.finish(reason, error_message)
        choices = self._requests[request.request_id]
        choices.remove(request)
        if not choices:
            del self._requests[request.request_id]
        if status is RequestStatus.RUNNING:
            self.policy.release(request)
        elif status is RequestStatus.HELD:  # only an abort of this one choice ends a held sibling
            self.queues.drop_held(request)
        else:
            self.queues.remove_waiting(request)
        if request.held_siblings:
            self.queues.release_held(request)
        self.constants.release(request)
        return self._outputs.add(request, token_id, reason, error_message, now)

