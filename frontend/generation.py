"""One request's run in the frontend: engine deltas -> per-choice safe text, stop strings, metrics, abort.

n > 1: the scheduler runs the n choices as sibling sequences. A choice that meets one of its stop
strings is finished HERE and its later tokens are ignored; while its siblings still run, the
scheduler is told to abort that one choice (its seat and KV blocks are freed at once, and its
terminal "abort" output only marks it engine-finished here). Once every choice is final, a choice
the scheduler still runs is dropped with the whole request, as on a client disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from starlette.types import Receive

from frontend.choice import ChoiceDelta, ChoiceOutput
from frontend.engine_client import EngineClient, EngineUnavailableError
from frontend.engine_outputs import EngineDelta, TokenLogprob
from frontend.errors import REFUSAL_ERROR_CODES
from frontend.metrics import FrontendMetrics
from frontend.tokenizer import Tokenizer
from frontend.validation import GenerationJob
from proto.messages import FinishReason

FAILURE_REASONS = (FinishReason.ERROR, FinishReason.ABORT)


class Generation:
    """Runs one job against the engine. Invariant: when `deltas()` ends, every choice has its
    finish reason and the scheduler either finished the request itself or was sent an abort."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, metrics: FrontendMetrics,
                 request_id: str, job: GenerationJob, arrival_s: float,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        """`arrival_s`: when the HTTP request arrived, on this process's monotonic clock;
        `eos_token_ids`: the model's (EngineConfig's), which end a choice unless ignore_eos."""
        self.request_id = request_id
        self.job = job
        params = job.sampling_params
        stop_token_ids = frozenset() if job.include_stop_str else \
            frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos_token_ids)
        self.choices = [ChoiceOutput(index, tokenizer, job.prompt_token_ids, job.stop,
                                     params.min_tokens, params.logprobs >= 0, stop_token_ids,
                                     job.include_stop_str, job.skip_special_tokens,
                                     frozenset(params.stop_token_ids))
                        for index in range(params.n)]
        self.prompt_logprobs: dict[int, TokenLogprob] = {}  # by position, when echo asked for them
        self.error_message = ""
        self._engine = engine
        self._metrics = metrics
        self._abort_requested = False
        self._abort_sent = False
        self._prompt_recorded = False
        self._stream: AsyncGenerator[EngineDelta, None] | None = None  # once set, the scheduler knows it
        self._start_called = False
        self._pending: list[ChoiceDelta] = []  # what start() read, for deltas() to yield first
        self._rejected = False  # never taken: the engine was down, or the scheduler refused it
        self._closed = False
        self._arrival_s = arrival_s
        self._last_token_s: list[float | None] = [None] * params.n  # per choice, receive clock
        self._first_token_s: list[float | None] = [None] * params.n
        self.created_s = int(time.time())  # OpenAI's `created`: wall-clock seconds

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.job.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(choice.num_tokens for choice in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, as reported for choice 0 (whose blocks the
        sibling choices share)."""
        return self.choices[0].num_cached_tokens

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason for choice in self.choices)

    @property
    def failure(self) -> ChoiceOutput | None:
        """The choice whose failure the request reports, if one ended with "error" or "abort" (the
        request then failed): the first "error" (its siblings were aborted for it), else the first
        "abort"."""
        failed = [c for c in self.choices if c.finish_reason in FAILURE_REASONS]
        return next((c for c in failed if c.finish_reason == FinishReason.ERROR), failed[0] if failed else None)

    def abort(self, message: str = "") -> None:
        """Free the scheduler's blocks; `deltas()` then ends every open choice with "abort"."""
        if not self.finished:
            self._abort_requested = True
            self.error_message = self.error_message or message  # the first reason given stays
            self._abort_engine()

    async def start(self) -> None:
        """Send the request; return once the scheduler has queued it or has already ended it (a
        refusal leaves `failure` set). A stream waits here before its first byte, so that a full
        queue is an HTTP 429 rather than an error event inside a 200 stream. Idempotent."""
        if self._start_called:
            return
        self._start_called = True
        if self._abort_requested:  # the client left before we asked the engine for anything
            self._pending = [c.end(FinishReason.ABORT, self.error_message) for c in self.choices if not c.finish_reason]
            return
        self._stream = self._engine.generate(self.request_id, self.job.prompt_token_ids,
                                             self.job.sampling_params, self.job.grammar)
        try:
            first = await anext(self._stream)
        except EngineUnavailableError:
            self._rejected = True  # the scheduler never took it: nothing to count
            await self.close()
            raise
        except BaseException:
            await self.close()
            raise
        update = self._handle(first)
        self._pending = [] if update is None else [update]

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        try:
            await self.start()
            pending, self._pending = self._pending, []
            for update in pending:
                yield update
            while not self.finished and self._stream is not None:
                delta = await anext(self._stream, None)
                if delta is None:
                    break
                update = self._handle(delta)
                if update is not None:
                    yield update
        finally:
            await self.close()

    async def run(self) -> None:
        """Run to the end (every choice final)."""
        async for _ in self.deltas():
            pass

    async def close(self) -> None:
        """End the run however it went: what the scheduler still runs is aborted, open choices end
        with "abort", and the request is counted once. Idempotent; the synchronous part comes
        first, so a cancelled caller still leaves nothing running."""
        if self._closed:
            return
        self._closed = True
        counted = self._stream is not None and not self._rejected
        if not self.finished:  # cancelled or closed early: never leave it running
            self._abort_engine()
            now_s = time.monotonic()
            for choice in self.choices:
                if not choice.finish_reason:
                    ended = choice.end(FinishReason.ABORT, self.error_message)
                    if counted:
                        self._record(choice, ended, now_s)
        if counted:
            self._metrics.record_request_finished(self.num_prompt_tokens, len(self.choices),
                                                  0 if self.job.echo_only else self.job.sampling_params.max_tokens,
                                                  max(choice.num_tokens for choice in self.choices))
        if self._stream is not None:
            await self._stream.aclose()

    def _handle(self, delta: EngineDelta) -> ChoiceDelta | None:
        update = self._consume(delta)
        if self.finished and not all(c.engine_finished for c in self.choices):
            self._abort_engine()  # the rest run on only for choices we already ended
        elif update is not None and update.finish_reason == FinishReason.ERROR:
            self._abort_engine()  # the response fails now: its other choices would run for nothing
        elif update is not None and update.finish_reason:
            self._abort_choice_if_running(update.index)
        return update

    def _consume(self, delta: EngineDelta) -> ChoiceDelta | None:
        choice = self.choices[delta.choice_index]
        for entry in delta.logprobs:
            if entry.position < self.num_prompt_tokens:
                self.prompt_logprobs.setdefault(entry.position, entry)
        update = choice.push(delta)  # None for a choice already final here (tokens ignored)
        if update is not None:
            self._record(choice, update, delta.received_s)
        if choice.finish_reason in FAILURE_REASONS and not self.error_message:
            self.error_message = choice.error_message
        return update

    def _record(self, choice: ChoiceOutput, update: ChoiceDelta, received_s: float) -> None:
        if update.token_ids:
            if not self._prompt_recorded:
                self._prompt_recorded = True
                self._metrics.record_prompt(self.num_prompt_tokens)
            last_s = self._last_token_s[choice.index]
            latency_s = received_s - (self._arrival_s if last_s is None else last_s)
            self._metrics.record_choice_tokens(len(update.token_ids), latency_s, last_s is None)
            self._last_token_s[choice.index] = received_s
            if last_s is None:
                self._first_token_s[choice.index] = received_s
        if update.finish_reason and choice.error_code in REFUSAL_ERROR_CODES:
            self._rejected = True  # never ran: not a finished request (a 429 counts as a rejection)
        elif update.finish_reason:
            first_s, last_s = self._first_token_s[choice.index], self._last_token_s[choice.index]
            self._metrics.record_choice_finished(update.finish_reason, received_s - self._arrival_s, choice.num_tokens,
                                                 None if first_s is None or last_s is None else last_s - first_s)

    def _abort_choice_if_running(self, index: int) -> None:
        """A choice that ended here (a stop string) while the scheduler still runs it: free its
        sequence now rather than when its siblings end."""
        if not self.choices[index].engine_finished:
            self._engine.abort_choice(self.request_id, index)

    def _abort_engine(self) -> None:
        # Our disconnect watcher and Starlette's cancellation can both fire: one abort is enough.
        if self._stream is not None and not self._abort_sent:
            self._abort_sent = True
            self._engine.abort(self.request_id)


@contextlib.asynccontextmanager
async def abort_on_disconnect(receive: Receive, abort: Callable[[], None]) -> AsyncIterator[None]:
    """Call `abort` if the ASGI client disconnects while the body of this block runs.

    The request body has been read already, so the next ASGI message can only be the disconnect.
    """

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        abort()

    watcher = asyncio.create_task(watch(), name="disconnect-watcher")
    await asyncio.sleep(0)  # a disconnect already there is seen before the body asks the engine
    try:
        yield
    finally:
        watcher.cancel()
