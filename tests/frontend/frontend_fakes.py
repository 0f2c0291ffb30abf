"""An in-process fake engine that speaks real StepOutputs through the real OutputRouter."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from frontend.engine_outputs import EngineDelta, EngineListener, OutputRouter
from proto import codec
from proto.grammar import GrammarSpec
from proto.logprobs import LogprobEntries
from proto.messages import (ERROR_NONE, EVENT_FINISHED, EVENT_FIRST_TOKEN, EVENT_PREEMPTED,
                            EVENT_QUEUED, EVENT_SCHEDULED, AddRequest, LifecycleEvents, SchedulerStats,
                            StepOutputs)
from proto.sampling import SamplingParams

QUEUE_S, PREFILL_S, DECODE_STEP_S = 0.25, 0.5, 0.125  # fake scheduler clock per phase
STEP_DURATION_S = 0.004


def sampled_logprob(position: int, choice: int) -> float:
    """The fake logprob of the token a choice sampled at `position` (its top-1 alternative)."""
    return -0.25 * (choice + 1) - position / 1024


def prompt_logprob(position: int) -> float:
    return -1.0 - position / 64


@dataclass
class AddedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    grammar: GrammarSpec | None = None


def through_codec(message: AddRequest) -> AddRequest:
    """`message` as the scheduler decodes it."""
    return codec.decode(codec.encode(message), AddRequest)


@dataclass
class _Row:
    """One output row of a fake step."""

    choice: int
    token_ids: list[int]
    finish_reason: str = ""
    error_message: str = ""
    error_code: int = ERROR_NONE
    entries: list[tuple[int, int, float, list[tuple[int, float]]]] = field(default_factory=list)


class FakeEngineClient:
    """Answers each request with `reply_token_ids` (choice c: `choice_replies[c]` when set),
    `tokens_per_step` a step, with lifecycle events, logprobs and stats like the scheduler's.

    A choice ends with "length" when max_tokens cuts its reply, else with `finish_reason`. With
    `hang` it sends the replies but never finishes (until aborted, or `finish_running`); with
    `fail_with` it errors at once (with the ERROR_* code `fail_code`; only the requests added from
    the `fail_from`-th on). Every step is routed at
    once; the request's stream then reads them at its own pace (with `hold`, only once released).
    A coded failure (a full queue) is
    a refusal at admission, as the scheduler's: no lifecycle event but FINISHED.
    """

    def __init__(self, reply_token_ids: list[int]) -> None:
        self.reply_token_ids = reply_token_ids
        self.choice_replies: list[list[int]] | None = None
        self.tokens_per_step = 1
        self.finish_reason = "stop"
        self.fail_with = ""
        self.fail_code = ERROR_NONE
        self.fail_from = 0  # fail_with applies to the requests added from this one on (0: all)
        self.hang = False
        self.hold = False  # the scheduler says nothing (not even "queued") until release_held()
        self.held: list[tuple[str, list[int], SamplingParams]] = []
        self.preempt = False  # each request is preempted once, after its first token
        self.alive = True
        self.num_running, self.num_waiting, self.kv_cache_usage = 2, 3, 0.25
        self.num_waiting_tokens = 40
        self.max_num_seqs = 4
        self.num_cached_tokens = 0
        self.scheduler_protocol_errors = 0
        self.added: list[AddedRequest] = []
        self.aborted: list[str] = []
        self.aborted_choices: list[tuple[str, int]] = []
        self.started = False
        self.router = OutputRouter()
        self.totals = {"num_preemptions_total": 0, "prefix_cache_queries_total": 0,
                       "prefix_cache_hits_total": 0}
        self.num_steps = 0
        self.num_scheduled_tokens_total = 0
        self._clock_s = 1000.0
        self._running: dict[str, set[int]] = {}  # hanging requests: their unfinished choices

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False

    def is_alive(self) -> bool:
        return self.alive

    def add_listener(self, listener: EngineListener) -> None:
        self.router.add_listener(listener)

    @property
    def latest_stats(self) -> SchedulerStats | None:
        return self.router.latest_stats

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       grammar: GrammarSpec | None = None) -> AsyncIterator[EngineDelta]:
        route = self.router.open(request_id, sampling_params.n)
        # Through the real codec, as the ZMQ client sends it: what cannot travel fails here too.
        wire = through_codec(AddRequest(request_id, np.asarray(prompt_token_ids, np.int32),
                                        sampling_params, time.time(), grammar))
        self.added.append(AddedRequest(request_id, wire.prompt_token_ids.tolist(), wire.sampling_params,
                                       wire.grammar))
        if self.hold:
            self.held.append((request_id, list(prompt_token_ids), sampling_params))
        else:
            self._run(request_id, list(prompt_token_ids), sampling_params)
        async for delta in route.deltas():
            yield delta

    def heartbeat(self) -> None:
        """An idle scheduler's message: the current stats and nothing else."""
        self._send("", [], [], step=False)

    def release_held(self) -> None:
        """Answer the held requests that are still open, as `hold` had been off."""
        held, self.held, self.hold = self.held, [], False
        for request_id, prompt, params in held:
            if self.router.is_open(request_id):
                self._run(request_id, prompt, params)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.router.abort(request_id)
        open_choices = self._running.pop(request_id, set())
        events = [(request_id, choice, EVENT_FINISHED) for choice in sorted(open_choices)]
        self._send(request_id, [], events, step=False)

    def abort_choice(self, request_id: str, choice_index: int) -> None:
        self.aborted_choices.append((request_id, choice_index))
        if choice_index in self._running.get(request_id, ()):
            self.finish_running(request_id, "abort", choices=(choice_index,))

    def finish_running(self, request_id: str, finish_reason: str = "stop",
                       choices: tuple[int, ...] = (), error_message: str = "") -> None:
        """End a hanging request's running `choices` (default: all of them) with `finish_reason`."""
        running = self._running.get(request_id, set())
        ended = sorted(set(choices or running) & running)
        running.difference_update(ended)
        if not running:
            self._running.pop(request_id, None)
        self._send(request_id, [_Row(c, [], finish_reason, error_message) for c in ended],
                   [(request_id, c, EVENT_FINISHED) for c in ended], step=False)

    def reply_of(self, choice: int) -> list[int]:
        return self.choice_replies[choice] if self.choice_replies else self.reply_token_ids

    def _run(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        choices = range(params.n)
        fail_with = self.fail_with if [r.request_id for r in self.added].index(request_id) >= self.fail_from else ""
        if fail_with and self.fail_code != ERROR_NONE:  # refused at admission: never queued
            rows = [_Row(c, [], "error", fail_with, self.fail_code) for c in choices]
            self._send(request_id, rows, [(request_id, c, EVENT_FINISHED) for c in choices], step=False)
            return
        events = [(request_id, c, EVENT_QUEUED) for c in choices]
        self._send(request_id, [], events, step=False)
        self._clock_s += QUEUE_S
        self._send(request_id, [], [(request_id, c, EVENT_SCHEDULED) for c in choices], step=False)
        self._clock_s += PREFILL_S
        if fail_with:
            rows = [_Row(c, [], "error", fail_with, self.fail_code) for c in choices]
            self._send(request_id, rows, [(request_id, c, EVENT_FINISHED) for c in choices])
            return
        replies = [self.reply_of(c)[:params.max_tokens] for c in choices]
        num_steps = max(-(-len(r) // self.tokens_per_step) for r in replies)
        self._running[request_id] = set(choices)
        for step in range(num_steps):
            rows, events = self._step_rows(request_id, prompt, params, replies, step)
            self._send(request_id, rows, events, num_prefill=len(prompt) if step == 0 else 0)
            self._clock_s += DECODE_STEP_S
        if not self._running[request_id]:
            del self._running[request_id]

    def _step_rows(self, request_id: str, prompt: list[int], params: SamplingParams,
                   replies: list[list[int]], step: int) -> tuple[list[_Row], list]:
        rows, events = [], []
        size = self.tokens_per_step
        for choice, reply in enumerate(replies):
            tokens = reply[step * size:(step + 1) * size]
            if step > 0 and step * size >= len(reply):  # this choice has finished already
                continue
            row = _Row(choice, tokens)
            if step == 0:
                events.append((request_id, choice, EVENT_FIRST_TOKEN))
                if choice == 0 and params.prompt_logprobs >= 0:
                    row.entries += _prompt_entries(prompt, params.prompt_logprobs)
            if params.logprobs >= 0:
                start = len(prompt) + step * size
                row.entries += [_sampled_entry(start + i, t, choice, params.logprobs)
                                for i, t in enumerate(tokens)]
            if self.preempt and step == 1 and choice == 0:
                events.append((request_id, choice, EVENT_PREEMPTED))
                self.totals["num_preemptions_total"] += 1
            if (step + 1) * size >= len(reply) and not self.hang:
                full = len(self.reply_of(choice)) >= params.max_tokens
                row.finish_reason = "length" if full else self.finish_reason
                events.append((request_id, choice, EVENT_FINISHED))
                self._running[request_id].discard(choice)
            rows.append(row)
        return rows, events

    def _send(self, request_id: str, rows: list[_Row], events: list, step: bool = True,
              num_prefill: int = 0) -> None:
        if step and num_prefill:
            self.totals["prefix_cache_queries_total"] += num_prefill
            self.totals["prefix_cache_hits_total"] += self.num_cached_tokens
        num_scheduled = num_prefill - self.num_cached_tokens if num_prefill else len(rows)
        if step:
            self.num_steps += 1
            self.num_scheduled_tokens_total += num_scheduled
        self.router.route(self._outputs(request_id, rows, events, step, num_scheduled), time.monotonic())

    def _outputs(self, request_id: str, rows: list[_Row], events: list, step: bool,
                 num_scheduled: int) -> StepOutputs:
        lengths = [len(r.token_ids) for r in rows]
        entries = [(index, e) for index, r in enumerate(rows) for e in r.entries]
        cu_top = np.concatenate([[0], np.cumsum([len(e[3]) for _, e in entries])]).astype(np.int32)
        return StepOutputs(
            step_id=self.num_steps if step else -1, request_ids=[request_id] * len(rows),
            cu_new_tokens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            new_token_ids=np.array([t for r in rows for t in r.token_ids], dtype=np.int32),
            finish_reasons=[r.finish_reason for r in rows],
            error_messages=[r.error_message for r in rows],
            stats=SchedulerStats(
                num_running=self.num_running, num_waiting=self.num_waiting,
                num_waiting_tokens=self.num_waiting_tokens, kv_cache_usage=self.kv_cache_usage,
                num_preemptions_total=self.totals["num_preemptions_total"],
                num_protocol_errors_total=self.scheduler_protocol_errors,
                prefix_cache_queries_total=self.totals["prefix_cache_queries_total"],
                prefix_cache_hits_total=self.totals["prefix_cache_hits_total"]),
            step_duration_s=STEP_DURATION_S if step else 0.0, wall_time_s=self._clock_s,
            choice_indices=np.array([r.choice for r in rows], dtype=np.int32),
            num_cached_tokens=np.full(len(rows), self.num_cached_tokens, dtype=np.int32),
            error_codes=np.array([r.error_code for r in rows], dtype=np.uint8),
            events=LifecycleEvents(
                request_ids=[e[0] for e in events],
                choice_indices=np.array([e[1] for e in events], dtype=np.int32),
                kinds=np.array([e[2] for e in events], dtype=np.uint8),
                times_s=np.full(len(events), self._clock_s, dtype=np.float64)),
            num_scheduled_tokens=num_scheduled if step else 0,
            logprobs=LogprobEntries(
                rows=np.array([index for index, _ in entries], dtype=np.int32),
                positions=np.array([e[0] for _, e in entries], dtype=np.int32),
                token_ids=np.array([e[1] for _, e in entries], dtype=np.int32),
                logprobs=np.array([e[2] for _, e in entries], dtype=np.float32),
                ranks=np.ones(len(entries), dtype=np.int32),  # _top: each token is its own best
                cu_top=cu_top,
                top_token_ids=np.array([t for _, e in entries for t, _ in e[3]], dtype=np.int32),
                top_logprobs=np.array([lp for _, e in entries for _, lp in e[3]], dtype=np.float32)),
        )


def _top(token_id: int, logprob: float, k: int) -> list[tuple[int, float]]:
    """The token itself first, then made-up runners-up, each one nat less likely."""
    return [(token_id + i, logprob - i) for i in range(k)]


def _sampled_entry(position: int, token_id: int, choice: int, k: int) -> tuple:
    logprob = sampled_logprob(position, choice)
    return (position, token_id, logprob, _top(token_id, logprob, k))


def _prompt_entries(prompt: list[int], k: int) -> list[tuple]:
    return [(p, prompt[p], prompt_logprob(p), _top(prompt[p], prompt_logprob(p), k))
            for p in range(1, len(prompt))]
