"""The run of one generation request, shared by completions and chat: admit, stream or collect."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from frontend.choice import ChoiceDelta, ChoiceOutput
from frontend.engine_client import EngineUnavailableError
from frontend.errors import (INVALID_REQUEST_ERROR_CODE, QUEUE_LIMIT_OF_ERROR_CODE, APIError, bad_request,
                             too_many_requests)
from frontend.generation import Generation, abort_on_disconnect
from frontend.state import ServerState
from frontend.validation import GenerationJob
from proto.messages import FinishReason


class ResponseFormat(Protocol):
    """How one endpoint shapes its choices; everything else about serving is shared.

    One instance serves one request, so it may keep per-choice state across stream chunks.
    """

    id_prefix: str
    object_name: str  # non-streaming response
    chunk_object_name: str

    def first_choices(self, generation: Generation) -> list[dict[str, Any]]: ...

    def chunk_choices(self, generation: Generation, delta: ChoiceDelta) -> list[dict[str, Any]]:
        """The chunks for a step's text (or tool calls) and logprobs; none when it has neither."""

    def finish_choice(self, index: int, finish_reason: FinishReason) -> dict[str, Any]: ...

    def final_choice(self, generation: Generation, choice: ChoiceOutput) -> dict[str, Any]: ...


async def serve_job(state: ServerState, request: Request, job: GenerationJob, fmt: ResponseFormat,
                    arrival_s: float) -> Response:
    """Run and answer one validated job; `arrival_s` is time.monotonic() at arrival. A stream's
    headers wait until the scheduler has queued the request, so a refusal keeps its status."""
    state.check_serving()
    request_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
    generation = Generation(state.engine, state.tokenizer, state.metrics, request_id, job, arrival_s,
                            state.config.eos_token_ids)
    state.active.add(generation)
    handed_over = False
    try:
        async with abort_on_disconnect(request.receive, generation.abort):
            try:
                await (generation.start() if job.stream else generation.run())
            except EngineUnavailableError as exc:
                raise _unavailable(exc) from exc
        if generation.failure is not None:
            return _failure(state, generation).response()
        if job.stream:
            handed_over = True
            return GenerationStream(_sse_events(state, request, generation, fmt),
                                    lambda: _end(state, generation))
        body = _envelope(state, generation, fmt.object_name)
        body["choices"] = [fmt.final_choice(generation, choice) for choice in generation.choices]
        body["usage"] = _usage(generation)
        return JSONResponse(body)
    finally:
        if not handed_over:
            await _end(state, generation)


async def _end(state: ServerState, generation: Generation) -> None:
    state.active.discard(generation)
    await generation.close()


class GenerationStream(StreamingResponse):
    """SSE that ends its generation however the response ends: a client gone before the first
    byte means Starlette never starts the body iterator, so nothing inside it could clean up."""

    def __init__(self, events: AsyncGenerator[str, None], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await self._on_close()


async def _sse_events(state: ServerState, request: Request, generation: Generation,
                      fmt: ResponseFormat) -> AsyncGenerator[str, None]:
    include_usage = generation.job.include_usage
    envelope = _envelope(state, generation, fmt.chunk_object_name)
    if include_usage:
        envelope["usage"] = None

    def chunk(choice: dict[str, Any]) -> str:
        return _sse({**envelope, "choices": [choice]})

    async with abort_on_disconnect(request.receive, generation.abort):
        for first in fmt.first_choices(generation):
            yield chunk(first)
        try:
            async for delta in generation.deltas():
                for choice in fmt.chunk_choices(generation, delta):
                    yield chunk(choice)
                if delta.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    yield chunk(fmt.finish_choice(delta.index, delta.finish_reason))
        except EngineUnavailableError as exc:
            yield _sse(_unavailable(exc).body())
        else:
            if generation.failure is not None:
                yield _sse(_failure(state, generation).body())
            elif include_usage:
                yield _sse({**envelope, "choices": [], "usage": _usage(generation)})
        yield "data: [DONE]\n\n"


def _unavailable(exc: EngineUnavailableError) -> APIError:
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), "server_error")


def _failure(state: ServerState, generation: Generation) -> APIError:
    """The error a request that did not finish normally reports: 429 for a full scheduler queue
    (counted by the limit that refused it), 400 for one the scheduler found can never run as
    asked (e.g. more KV cache than the server has), else 500."""
    failed = generation.failure
    assert failed is not None, "only a request with a failed choice has a failure"
    message = generation.error_message or failed.error_message or "the request was aborted"
    if failed.finish_reason is FinishReason.ABORT:
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, "server_error", None, "aborted")
    limit = QUEUE_LIMIT_OF_ERROR_CODE.get(failed.error_code)  # the scheduler said so, by code
    if limit is not None:
        state.metrics.record_rejection(limit)
        return too_many_requests(message)
    if failed.error_code == INVALID_REQUEST_ERROR_CODE:
        return bad_request(message)
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, "server_error", None, "engine_error")


def _envelope(state: ServerState, generation: Generation, object_name: str) -> dict[str, Any]:
    return {"id": generation.request_id, "object": object_name, "created": generation.created_s,
            "model": state.model_name}


def _usage(generation: Generation) -> dict[str, Any]:
    """Completion tokens of all choices (none when only the prompt is echoed); the prompt (and
    its cache hits) counts once."""
    num_output_tokens = 0 if generation.job.echo_only else generation.num_output_tokens
    return {"prompt_tokens": generation.num_prompt_tokens,
            "completion_tokens": num_output_tokens,
            "total_tokens": generation.num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": generation.num_cached_tokens}}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
