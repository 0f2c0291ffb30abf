"""The scheduler's whole state in one object: live requests, queues, KV blocks and the step in flight."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from proto.config import EngineConfig
from proto.messages import AddRequest, StepOutputs, StepPlan, StepResult
from scheduler_proc.admission import rejection_reason
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.outputs import HEARTBEAT_STEP_ID, OutputBuffer, SchedulerStats
from scheduler_proc.plan_builder import build_plan
from scheduler_proc.policy import ScheduledSeq, make_policy
from scheduler_proc.queues import RequestQueues
from scheduler_proc.request import Request, RequestStatus, max_num_kv_tokens
from scheduler_proc.stop import check_stop, logit_biases, stop_token_set

logger = logging.getLogger(__name__)


class StepMismatchError(RuntimeError):
    """A StepResult that answers no plan in flight, or another step than the one in flight."""


@dataclass(frozen=True)
class _InFlightStep:
    step_id: int
    seqs: list[ScheduledSeq]
    num_sampled: int
    num_scheduled_tokens: int
    started_s: float  # time.perf_counter() when the plan was built


class SchedulerEngine:
    """Owns request lifecycle (waiting -> running -> finished; running -> waiting on preemption)
    and the KV block accounting. Plain synchronous code: the loop feeds it messages.

    Invariant: every request added gets exactly one output with a non-empty finish reason, after
    which the engine forgets it. Finished requests release seat and blocks before the next
    schedule() (a static batch keeps finished seats until the batch ends, by design).
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int, rng: random.Random | None = None) -> None:
        self.config = config
        self.block_manager = BlockManager(num_kv_blocks, config.block_size)
        self.queues = RequestQueues()
        self.policy = make_policy(config, self.block_manager, self.queues)
        self._rng = rng or random.Random()
        self._requests: dict[str, Request] = {}
        self._outputs = OutputBuffer()
        self._in_flight: _InFlightStep | None = None
        self._next_step_id = 0

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def in_flight_step_id(self) -> int | None:
        return None if self._in_flight is None else self._in_flight.step_id

    @property
    def num_padded_seat_steps_total(self) -> int:
        return self.policy.num_padded_seat_steps_total

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def add(self, message: AddRequest) -> None:
        """Queue a new request, or finish it at once with reason "error" if it can never run."""
        request_id = message.request_id
        if request_id in self._requests:
            logger.warning("duplicate request id %r rejected", request_id)
            self._outputs.add(request_id, [], "error", f"request id {request_id!r} is already in use")
            return
        reason = rejection_reason(message, self.config, self.block_manager.num_blocks,
                                  len(self.queues.waiting))
        if reason:
            self._outputs.add(request_id, [], "error", reason)
            return
        params = message.sampling_params
        # A drawn seed is kept for the request's life, so recompute after preemption resamples
        # exactly the same tokens.
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        stop_ids = stop_token_set(params, self.config.eos_token_ids)
        logit_bias, min_tokens_bias = logit_biases(params, stop_ids)
        num_kv_tokens = max_num_kv_tokens(len(message.prompt_token_ids), params.max_tokens,
                                          self.config.max_model_len)
        request = Request(request_id, message.prompt_token_ids, params, seed, message.arrival_time_s,
                          stop_ids, logit_bias, min_tokens_bias, num_kv_tokens)
        self._requests[request_id] = request
        self.queues.waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Finish waiting or running requests with reason "abort"; unknown ids (already finished,
        never seen) are ignored, since the frontend may abort after the final output crossed."""
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, "abort")

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to compute."""
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step_id} is still in flight")
        seqs = self.policy.schedule()
        if not seqs:
            return None
        plan = build_plan(self._next_step_id, seqs)
        num_sampled = int(plan.sample_mask.sum())
        self._in_flight = _InFlightStep(self._next_step_id, seqs, num_sampled, len(plan.input_ids),
                                        time.perf_counter())
        self._next_step_id += 1
        return plan

    def apply_result(self, result: StepResult) -> StepOutputs:
        """Append sampled tokens, advance progress, run stop checks and retire finished requests."""
        step = self._in_flight
        if step is None or result.step_id != step.step_id:
            expected = "no step" if step is None else f"step {step.step_id}"
            raise StepMismatchError(f"got a result for step {result.step_id} while {expected} is in flight")
        self._in_flight = None
        error = result.error or self._sampled_tokens_error(result.sampled_token_ids, step.num_sampled)
        if error:
            message = f"the worker failed step {step.step_id}: {error}"
            for seq in step.seqs:
                if not seq.request.is_finished:
                    self._finish(seq.request, "error", message)
        else:
            self._advance(step.seqs, result.sampled_token_ids.tolist())
        return self._outputs.build(step.step_id, self.stats(), time.perf_counter() - step.started_s,
                                   step.num_scheduled_tokens)

    def fail_running(self, error_message: str) -> StepOutputs:
        """The step in flight is lost (e.g. a worker timed out): every running request fails."""
        step_id = HEARTBEAT_STEP_ID if self._in_flight is None else self._in_flight.step_id
        self._in_flight = None
        for request in list(self.queues.running):
            self._finish(request, "error", error_message)
        return self._outputs.build(step_id, self.stats(), 0.0)

    def finish_all(self, error_message: str) -> StepOutputs:
        """Fail every unfinished request (shutdown): none may end without its terminal output."""
        self._in_flight = None
        for request in list(self._requests.values()):
            self._finish(request, "error", error_message)
        return self._outputs.build(HEARTBEAT_STEP_ID, self.stats(), 0.0)

    def drain_outputs(self) -> StepOutputs | None:
        """Outputs that belong to no step (rejections, aborts), or None if there are none."""
        if len(self._outputs) == 0:
            return None
        return self._outputs.build(HEARTBEAT_STEP_ID, self.stats(), 0.0)

    def heartbeat(self) -> StepOutputs:
        """Current stats (and any pending outputs) with step_id -1."""
        return self._outputs.build(HEARTBEAT_STEP_ID, self.stats(), 0.0)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.queues.running), num_waiting=len(self.queues.waiting),
                              kv_cache_usage=self.block_manager.usage,
                              num_preemptions_total=self.queues.num_preemptions_total,
                              num_padded_slot_steps_total=self.policy.num_padded_seat_steps_total)

    def check_invariants(self) -> None:
        self.block_manager.check_invariants()
        self.queues.check_invariants(self.config.max_num_seqs)
        queued = {r.request_id for r in self.queues.waiting} | {r.request_id for r in self.queues.running}
        assert queued == set(self._requests), "live requests and queued requests differ"
        for request in self._requests.values():
            assert not request.is_finished and 0 <= request.num_computed_tokens <= request.num_tokens

    def _advance(self, seqs: list[ScheduledSeq], sampled_token_ids: list[int]) -> None:
        sampled = iter(sampled_token_ids)
        for seq in seqs:
            token_id = next(sampled) if seq.sample else None
            request = seq.request
            if seq.is_padding or request.is_finished:
                continue  # a static batch's finished seat, or aborted while the step ran
            request.num_computed_tokens += seq.num_scheduled_tokens
            if token_id is None:
                continue  # a prefill chunk that did not reach the end of the known tokens
            request.append_output(token_id)
            reason = check_stop(request, self.config.max_model_len)
            if reason:
                self._finish(request, reason, token_ids=[token_id])
            else:
                self._outputs.add(request.request_id, [token_id])

    def _sampled_tokens_error(self, token_ids: np.ndarray, num_sampled: int) -> str:
        if len(token_ids) != num_sampled:
            return f"it returned {len(token_ids)} sampled tokens for {num_sampled} sampling members"
        vocab_size = self.config.vocab_size
        if num_sampled and (int(token_ids.min()) < 0 or (vocab_size and int(token_ids.max()) >= vocab_size)):
            return f"it sampled token ids outside [0, {vocab_size}): {token_ids.min()}..{token_ids.max()}"
        return ""

    def _finish(self, request: Request, reason: str, error_message: str = "",
                token_ids: list[int] | None = None) -> None:
        """Give the request its one terminal output and release its seat and blocks now."""
        was_running = request.status is RequestStatus.RUNNING
        request.finish(reason, error_message)
        del self._requests[request.request_id]
        if was_running:
            self.policy.release(request)
        else:
            self.queues.waiting.remove(request)
        self._outputs.add(request.request_id, token_ids or [], reason, error_message)
