"""The run of one generation request (one or more prompts), shared by completions and chat: admit, stream or collect."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from frontend.batch import GenerationBatch
from frontend.choice import ChoiceDelta, ChoiceOutput
from frontend.engine_client import EngineUnavailableError
from frontend.errors import (INVALID_REQUEST_ERROR_CODE, QUEUE_LIMIT_OF_ERROR_CODE, APIError, bad_request,
                             too_many_requests, unavailable)
from frontend.generation import Generation, abort_on_disconnect
from frontend.state import ServerState
from frontend.validation import GenerationJob
from proto.messages import FinishReason

logger = logging.getLogger(__name__)
MAX_CLIENT_REQUEST_ID_CHARS = 128  # of a client's X-Request-Id, as echoed and logged


class ResponseFormat(Protocol):
    """How one endpoint shapes its choices; everything else about serving is shared.

    One instance serves one prompt of one request, so it may keep per-choice state across stream
    chunks; the indexes it is given and writes are the choice's within its prompt.
    """

    id_prefix: str
    object_name: str  # non-streaming response
    chunk_object_name: str

    def first_choices(self, generation: Generation) -> list[dict[str, Any]]: ...

    def chunk_choices(self, generation: Generation, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The chunks for a step's text (or tool calls) and logprobs; none when it has neither."""

    def finish_choice(self, index: int, finish_reason: FinishReason) -> dict[str, Any]: ...

    def final_choice(self, generation: Generation, choice: ChoiceOutput) -> dict[str, Any]: ...

    def response_fields(self, generation: Generation) -> dict[str, Any]:
        """Fields of a whole (non-streamed) response beside choices and usage."""


async def serve_job(state: ServerState, request: Request, jobs: list[GenerationJob],
                    make_format: Callable[[], ResponseFormat], arrival_s: float) -> Response:
    """Run and answer validated jobs, one per prompt (frontend/batch.py); `arrival_s` is
    time.monotonic() at arrival. A stream's headers wait until the scheduler has queued every
    prompt, so a refusal keeps its status. One format per prompt: formats keep per-choice state."""
    state.check_serving()
    fmts = [make_format() for _ in jobs]
    request_id = f"{fmts[0].id_prefix}-{uuid.uuid4().hex}"
    # The client's X-Request-Id comes back on the response and names the request in our logs.
    client_id = request.headers.get("x-request-id", "")[:MAX_CLIENT_REQUEST_ID_CHARS]
    tracing = {"X-Request-Id": client_id or request_id}
    client_label = f" (X-Request-Id {client_id!r})" if client_id else ""
    engine_ids = [request_id] if len(jobs) == 1 else [f"{request_id}-{i}" for i in range(len(jobs))]
    batch = GenerationBatch(request_id, [
        Generation(state.engine, state.tokenizer, state.metrics, engine_id, job, arrival_s,
                   state.config.eos_token_ids) for engine_id, job in zip(engine_ids, jobs)])
    formats = dict(zip(batch.generations, fmts))
    state.active.update(batch.generations)
    handed_over, logged = False, False

    def log_abandoned(why: str) -> None:
        nonlocal logged
        if not logged and not all(generation.finished for generation in batch.generations):
            logged = True
            logger.info("request %s%s: %s; aborted", request_id, client_label, why)

    def client_gone() -> None:
        log_abandoned("the client disconnected")
        batch.abort()

    async def end() -> None:
        log_abandoned("its response ended first (the client left or stopped reading)")
        await _end(state, batch)

    try:
        async with abort_on_disconnect(request.receive, client_gone):
            try:
                await (batch.start() if jobs[0].stream else batch.run())
            except EngineUnavailableError as exc:
                unavailable_error = _unavailable(exc)
                unavailable_error.headers = {**(unavailable_error.headers or {}), **tracing}
                raise unavailable_error from exc
        failed = batch.failed
        if failed is not None:
            response = _failure(state, failed, client_label).response()
            response.headers.update(tracing)
            return response
        if jobs[0].stream:
            handed_over = True
            return GenerationStream(_sse_events(state, request, batch, formats, client_gone, client_label), end,
                                    tracing)
        body = _envelope(state, batch, fmts[0].object_name)
        body["choices"] = [_numbered({**formats[generation].final_choice(generation, choice),
                                      "stop_reason": choice.stop_reason}, index)
                           for generation, choice, index in batch.choices()]
        body["usage"] = _usage(batch)
        for generation in batch.generations:
            body.update(formats[generation].response_fields(generation))
        return JSONResponse(body, headers=tracing)
    finally:
        if not handed_over:
            await end()


async def _end(state: ServerState, batch: GenerationBatch) -> None:
    state.active.difference_update(batch.generations)
    await batch.close()


class GenerationStream(StreamingResponse):
    """SSE that ends its generation however the response ends: a client gone before the first
    byte means Starlette never starts the body iterator, so nothing inside it could clean up."""

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await self._on_close()


async def _sse_events(state: ServerState, request: Request, batch: GenerationBatch,
                      formats: dict[Generation, ResponseFormat], client_gone: Callable[[], None],
                      client_label: str) -> AsyncGenerator[str, None]:
    include_usage = batch.generations[0].job.include_usage
    envelope = _envelope(state, batch, formats[batch.generations[0]].chunk_object_name)
    if include_usage:
        envelope["usage"] = None

    continuous_usage = batch.generations[0].job.continuous_usage

    def chunk(choice: dict[str, Any], offset: int) -> str:
        usage = {"usage": _usage(batch)} if continuous_usage else {}  # vLLM's usage so far
        return _sse({**envelope, "choices": [_numbered(choice, offset + choice["index"])], **usage})

    async with abort_on_disconnect(request.receive, client_gone):
        for generation, fmt in formats.items():
            for first in fmt.first_choices(generation):
                yield chunk(first, batch.offset(generation))
        try:
            async for generation, delta in batch.deltas():
                fmt, offset = formats[generation], batch.offset(generation)
                for choice in fmt.chunk_choices(generation, delta):
                    yield chunk(choice, offset)
                if delta.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    stop_reason = generation.choices[delta.index].stop_reason  # vLLM's field
                    yield chunk({**fmt.finish_choice(delta.index, delta.finish_reason),
                                 "stop_reason": stop_reason}, offset)
        except EngineUnavailableError as exc:
            yield _sse(_unavailable(exc).body())
        else:
            failed = batch.failed
            if failed is not None:
                yield _sse(_failure(state, failed, client_label).body())
            elif include_usage:
                yield _sse({**envelope, "choices": [], "usage": _usage(batch)})
        yield "data: [DONE]\n\n"


def _numbered(choice: dict[str, Any], index: int) -> dict[str, Any]:
    """The choice as the response numbers it (prompt_index * n + its index in its prompt)."""
    return choice if choice["index"] == index else {**choice, "index": index}


def _unavailable(exc: EngineUnavailableError) -> APIError:
    return unavailable(str(exc))


def _failure(state: ServerState, generation: Generation, client_label: str = "") -> APIError:
    """The error a request that did not finish normally reports: 429 for a full scheduler queue
    (counted by the limit that refused it), 400 for one the scheduler found can never run as
    asked (e.g. more KV cache than the server has), else 500."""
    failed = generation.failure
    assert failed is not None, "only a request with a failed choice has a failure"
    message = generation.error_message or failed.error_message or "the request was aborted"
    if failed.finish_reason is FinishReason.ABORT:
        return unavailable(message, "aborted")
    limit = QUEUE_LIMIT_OF_ERROR_CODE.get(failed.error_code)  # the scheduler said so, by code
    if limit is not None:
        state.metrics.record_rejection(limit)
        return too_many_requests(message)
    if failed.error_code == INVALID_REQUEST_ERROR_CODE:
        return bad_request(message)
    logger.warning("request %s%s failed: %s", generation.request_id, client_label, message)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, "server_error", None, "engine_error")


def _envelope(state: ServerState, batch: GenerationBatch, object_name: str) -> dict[str, Any]:
    return {"id": batch.request_id, "object": object_name, "created": batch.created_s,
            "model": state.model_name}


def _usage(batch: GenerationBatch) -> dict[str, Any]:
    """Completion tokens of all choices (none when only the prompt is echoed); each prompt (and
    its cache hits) counts once, however many choices it has."""
    num_prompt_tokens = batch.num_prompt_tokens
    num_output_tokens = batch.num_output_tokens
    return {"prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": batch.num_cached_tokens}}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
