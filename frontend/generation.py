"""One request's run in the frontend: engine deltas -> safe text, stop strings, metrics, abort."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.types import Receive

from frontend.detokenizer import OutputText
from frontend.engine_client import EngineClient
from frontend.metrics import FrontendMetrics
from frontend.tokenizer import Tokenizer
from frontend.validation import GenerationJob


@dataclass(frozen=True)
class TextDelta:
    """Text that is safe to send; `finish_reason` is set on the last one only."""

    text: str
    finish_reason: str = ""
    error_message: str = ""


class Generation:
    """Runs one job against the engine. Invariant: when `deltas()` ends, `finish_reason` is set
    and the scheduler either finished the request itself or was sent an abort for it."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, metrics: FrontendMetrics,
                 request_id: str, job: GenerationJob, arrival_s: float) -> None:
        """`arrival_s`: when the HTTP request arrived, on this process's monotonic clock."""
        self.request_id = request_id
        self.job = job
        self.output = OutputText(tokenizer, job.prompt_token_ids, job.stop,
                                 job.sampling_params.min_tokens)
        self.finish_reason = ""
        self.error_message = ""
        self._engine = engine
        self._metrics = metrics
        self._abort_requested = False
        self._started = False  # generate() was called: the scheduler knows the request
        self._abort_sent = False
        self._arrival_s = arrival_s
        self.created_s = int(time.time())  # OpenAI's `created`: wall-clock seconds

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.job.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.output.num_tokens

    def abort(self, message: str = "") -> None:
        """Free the scheduler's blocks; `deltas()` then ends with "abort" (and `message`, if any)."""
        if not self.finish_reason:
            self._abort_requested = True
            self.error_message = message
            self._abort_engine()

    async def deltas(self) -> AsyncIterator[TextDelta]:
        if self._abort_requested:  # the client left before we asked the engine for anything
            self.finish_reason = "abort"
            yield TextDelta("", self.finish_reason, self.error_message)
            return
        self._started = True
        stream = self._engine.generate(self.request_id, self.job.prompt_token_ids,
                                       self.job.sampling_params)
        try:
            async for delta in stream:
                if delta.token_ids:
                    self._record_tokens(len(delta.token_ids))
                text = self.output.push(delta.token_ids, final=bool(delta.finish_reason))
                if self.output.stopped:
                    if not delta.finish_reason:  # the scheduler would keep generating otherwise
                        self._abort_engine()
                    self.finish_reason = "stop"
                elif delta.finish_reason:
                    self.finish_reason = delta.finish_reason
                    self.error_message = delta.error_message or self.error_message
                if text or self.finish_reason:
                    yield TextDelta(text, self.finish_reason, self.error_message)
                if self.finish_reason:
                    return
        finally:
            if not self.finish_reason:  # cancelled or closed early: never leave it running
                self._abort_engine()
                self.finish_reason = "abort"
            await stream.aclose()
            self._metrics.record_finished(time.monotonic() - self._arrival_s)

    async def text(self) -> str:
        """Run to the end and return the whole output text."""
        async for _ in self.deltas():
            pass
        return self.output.text

    def _abort_engine(self) -> None:
        # Our disconnect watcher and Starlette's cancellation can both fire: one abort is enough.
        if self._started and not self._abort_sent:
            self._abort_sent = True
            self._engine.abort(self.request_id)

    def _record_tokens(self, num_tokens: int) -> None:
        if self.output.num_tokens == 0:
            self._metrics.record_first_token(self.num_prompt_tokens, time.monotonic() - self._arrival_s)
        self._metrics.record_tokens(num_tokens)


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
    try:
        yield
    finally:
        watcher.cancel()
