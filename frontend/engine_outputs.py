"""Routing of the scheduler's StepOutputs to in-flight requests, by (request id, choice index).

Transport-free: the ZMQ client feeds it decoded messages, and so does the tests' fake engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from proto.messages import (ERROR_CODES, EVENT_QUEUED, AddRequest, FinishReason, ResumedOutputs,
                            SchedulerStats, StepOutputs)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenLogprob:
    """log P(token_id) at sequence `position` (raw model logits), its rank (how many tokens are at
    least as likely, itself included, as vLLM counts it; 0 where not computed: sampled tokens), with
    the top alternatives.

    A position below the prompt length is a prompt token (prompt_logprobs).
    """

    position: int
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), descending
    rank: int


@dataclass(frozen=True)
class EngineDelta:
    """One step's news for one choice. `finish_reason` is NONE until the choice's single terminal
    delta; `error_code` names the kind of an "error" finish that has one (proto ERROR_CODES, e.g.
    "queue_full"), else it is empty. A request's first delta is an empty one (no tokens, no
    finish) once the scheduler has queued it, unless its first news is a refusal."""

    token_ids: list[int]
    finish_reason: FinishReason = FinishReason.NONE
    error_message: str = ""
    choice_index: int = 0
    num_cached_tokens: int = 0  # prompt tokens this choice got from the prefix cache (as reported)
    logprobs: tuple[TokenLogprob, ...] = ()  # prompt and sampled-token entries, as they came
    received_s: float = field(default=0.0, compare=False)  # our monotonic clock at receipt
    error_code: str = ""


class EngineListener(Protocol):
    """Sees every decoded StepOutputs (after routing) and every frame that failed to decode."""

    def on_step_outputs(self, outputs: StepOutputs) -> None: ...

    def on_protocol_error(self) -> None: ...

    def on_scheduler_replaced(self, num_sequences_resubmitted: int) -> None: ...


class RequestRoute:
    """One request's queue. Invariant: each choice gets exactly one terminal delta, after which
    nothing more is queued for it; the stream ends after the last choice's terminal delta.

    It also keeps what a replaced scheduler needs to continue the request (`resubmission`): the
    AddRequest as first sent, every output token queued per choice, the prompt logprob positions
    received, and the choices the frontend ended itself (abort_choice)."""

    def __init__(self, num_choices: int, add: AddRequest | None = None) -> None:
        self.num_choices = num_choices
        self.queue: asyncio.Queue[EngineDelta] = asyncio.Queue()
        self.finished: set[int] = set()
        self.add = add
        self.output_token_ids: list[list[int]] = [[] for _ in range(num_choices)]
        self.num_prompt_logprobs_received = 0  # prompt positions below this have their entry
        self.ended_here: set[int] = set()  # choices aborted alone by the frontend (a stop string)

    @property
    def done(self) -> bool:
        return len(self.finished) == self.num_choices

    def put(self, delta: EngineDelta) -> None:
        if delta.choice_index in self.finished:
            return
        self.output_token_ids[delta.choice_index].extend(delta.token_ids)
        if delta.logprobs and self.add is not None:
            num_prompt = len(self.add.prompt_token_ids)
            prompt_positions = [entry.position for entry in delta.logprobs if entry.position < num_prompt]
            if prompt_positions:
                self.num_prompt_logprobs_received = max(self.num_prompt_logprobs_received,
                                                        max(prompt_positions) + 1)
        if delta.finish_reason:
            self.finished.add(delta.choice_index)
        self.queue.put_nowait(delta)

    def end_all(self, finish_reason: FinishReason, error_message: str = "") -> None:
        """A terminal delta for every choice still open (abort, engine failure)."""
        now_s = time.monotonic()
        for index in range(self.num_choices):
            self.put(EngineDelta([], finish_reason, error_message, index, received_s=now_s))

    def resubmission(self) -> AddRequest | None:
        """The AddRequest that continues this request on a new scheduler (AddRequest.resume), or
        None when no choice is left to run. Choices the frontend ended itself get here the
        terminal "abort" delta that the lost scheduler would have sent."""
        assert self.add is not None, "a route opened without its AddRequest cannot be resubmitted"
        for index in self.ended_here - self.finished:
            self.put(EngineDelta([], FinishReason.ABORT, "", index, received_s=time.monotonic()))
        if self.done:
            return None
        lengths = [len(token_ids) for token_ids in self.output_token_ids]
        resume = ResumedOutputs(
            cu_token_ids=np.concatenate(([0], np.cumsum(lengths))).astype(np.int32),  # [n + 1]
            token_ids=np.asarray([t for token_ids in self.output_token_ids for t in token_ids], dtype=np.int32),
            finished=np.asarray([index in self.finished for index in range(self.num_choices)], dtype=np.bool_),
            num_prompt_logprobs_received=self.num_prompt_logprobs_received)
        return dataclasses.replace(self.add, resume=resume)

    async def deltas(self) -> AsyncIterator[EngineDelta]:
        num_finished = 0
        while num_finished < self.num_choices:
            delta = await self.queue.get()
            num_finished += bool(delta.finish_reason)
            yield delta


class OutputRouter:
    """Owns the routes of in-flight requests and the latest scheduler stats."""

    def __init__(self) -> None:
        self._routes: dict[str, RequestRoute] = {}
        self._listeners: list[EngineListener] = []
        self.latest_stats: SchedulerStats | None = None  # of the last message (a step or a heartbeat)
        # Outputs for ids with no open route: requests this process ended already (a client
        # disconnect, a stop string) or never sent (an earlier frontend's, after a restart).
        self.num_unknown_outputs = 0

    def __len__(self) -> int:
        return len(self._routes)

    def add_listener(self, listener: EngineListener) -> None:
        self._listeners.append(listener)

    def open(self, request_id: str, num_choices: int, add: AddRequest | None = None) -> RequestRoute:
        if request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is already in flight")
        route = self._routes[request_id] = RequestRoute(num_choices, add)
        return route

    def end_choice_here(self, request_id: str, choice_index: int) -> None:
        """The frontend ended this choice itself (and asks the scheduler to abort it)."""
        route = self._routes.get(request_id)
        if route is not None:
            route.ended_here.add(choice_index)

    def resubmissions(self) -> list[AddRequest]:
        """A new scheduler replaced the lost one: the AddRequest that continues each open request
        (routes with no choice left to run end now)."""
        adds = []
        for request_id, route in list(self._routes.items()):
            add = route.resubmission()
            if add is None:
                del self._routes[request_id]
            else:
                adds.append(add)
        return adds

    def scheduler_replaced(self, num_sequences_resubmitted: int) -> None:
        """Tell listeners (restart and recovery counters) that a new scheduler took over, with
        `num_sequences_resubmitted` choices handed to it to run on (0 if the resubmission failed)."""
        for listener in self._listeners:
            listener.on_scheduler_replaced(num_sequences_resubmitted)

    def is_open(self, request_id: str) -> bool:
        return request_id in self._routes

    def discard(self, request_id: str) -> None:
        self._routes.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """End every open choice with "abort"; False when the request had ended already."""
        route = self._routes.pop(request_id, None)
        if route is None:
            return False
        route.end_all(FinishReason.ABORT)
        return True

    def fail_all(self, message: str) -> int:
        """End every open request with "error"; return how many there were."""
        routes, self._routes = self._routes, {}
        for route in routes.values():
            route.end_all(FinishReason.ERROR, message)
        return len(routes)

    def protocol_error(self) -> None:
        for listener in self._listeners:
            listener.on_protocol_error()

    def route(self, outputs: StepOutputs, received_s: float) -> None:
        """Queue each output for its (request, choice); outputs of unknown requests are dropped."""
        self.latest_stats = outputs.stats
        for request_id in _queued_request_ids(outputs):  # before this message's tokens
            route = self._routes.get(request_id)
            if route is not None:
                route.put(EngineDelta([], received_s=received_s))
        entries = _logprobs_by_row(outputs)
        # Python lists once per message: numpy scalar indexing per row costs more than the copy.
        num_outputs = outputs.num_outputs
        choices = outputs.choice_indices.tolist() if len(outputs.choice_indices) else [0] * num_outputs
        cached = outputs.num_cached_tokens.tolist() if len(outputs.num_cached_tokens) else [0] * num_outputs
        codes = [ERROR_CODES[code] for code in outputs.error_codes.tolist()] or [""] * num_outputs
        cu_new_tokens, new_token_ids = outputs.cu_new_tokens.tolist(), outputs.new_token_ids.tolist()
        for row, request_id in enumerate(outputs.request_ids):
            route = self._routes.get(request_id)
            if route is None:
                self.num_unknown_outputs += 1
                logger.debug("dropping an output for request %s, which is not in flight here (%d so far)",
                             request_id, self.num_unknown_outputs)
                continue
            choice = choices[row]
            if not 0 <= choice < route.num_choices:
                logger.error("request %s has %d choices; dropping output for choice %d",
                             request_id, route.num_choices, choice)
                continue
            token_ids = new_token_ids[cu_new_tokens[row]:cu_new_tokens[row + 1]]
            route.put(EngineDelta(token_ids, outputs.finish_reasons[row], outputs.error_messages[row],
                                  choice, cached[row], entries.get(row, ()), received_s, codes[row]))
            if route.done:
                del self._routes[request_id]
        for listener in self._listeners:
            listener.on_step_outputs(outputs)


def _queued_request_ids(outputs: StepOutputs) -> list[str]:
    """Requests this message reports as queued (their choice 0's QUEUED event)."""
    events = outputs.events
    if not len(events):
        return []
    queued = (events.kinds == EVENT_QUEUED) & (events.choice_indices == 0)  # bool [num_events]
    return [events.request_ids[index] for index in np.flatnonzero(queued).tolist()]


def _logprobs_by_row(outputs: StepOutputs) -> dict[int, tuple[TokenLogprob, ...]]:
    entries = outputs.logprobs
    if not len(entries):
        return {}
    by_row: dict[int, list[TokenLogprob]] = {}
    cu_top = entries.cu_top.tolist()
    top_ids, top_logprobs = entries.top_token_ids.tolist(), entries.top_logprobs.tolist()
    columns = zip(entries.rows.tolist(), entries.positions.tolist(),
                  entries.token_ids.tolist(), entries.logprobs.tolist(), entries.ranks.tolist())
    for entry, (row, position, token_id, logprob, rank) in enumerate(columns):
        start, end = cu_top[entry], cu_top[entry + 1]
        top = tuple(zip(top_ids[start:end], top_logprobs[start:end]))
        by_row.setdefault(row, []).append(TokenLogprob(position, token_id, logprob, top, rank))
    return {row: tuple(found) for row, found in by_row.items()}

