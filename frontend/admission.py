"""The HTTP edge's first answers: requests refused before any work is spent on them, and clients
too slow to keep what they hold.

The middlewares are pure ASGI, so streams pass through untouched. Order (outermost first): the
HTTP answer count (http_metrics.py), CORS, the API key check, SlowClientMiddleware,
BodyLimitMiddleware, AdmissionMiddleware, then the app.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from http import HTTPStatus
from typing import TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.errors import APIError, too_many_requests
from frontend.state import ServerState

logger = logging.getLogger(__name__)
T = TypeVar("T")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})
# /tokenize and /detokenize requests parsed at once (429 beyond): each may parse a body of up to
# --max-request-body-size into a token list, so their count bounds the memory they take.
MAX_TOKENIZER_IN_FLIGHT = 4


class AdmissionMiddleware:
    """A generation request is refused (429 with Retry-After, or 503) before its body is read,
    or else counted in `num_in_flight` until its response has ended, however it ends (a client
    gone before the first byte included). Everything expensive happens inside that count. A
    /tokenize or /detokenize request counts in `num_tokenizer_in_flight` (within
    MAX_TOKENIZER_IN_FLIGHT) from the end of its body to the end of its response."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self._state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if scope["path"] in TOKENIZER_PATHS:
            await self._tokenizer_request(scope, receive, send)
            return
        if scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            self._state.check_admission()
        except APIError as refusal:
            await refusal.response()(scope, receive, send)
            return
        self._state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._state.num_in_flight -= 1

    async def _tokenizer_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The slot is taken once the body has arrived (parsing it is what costs memory), so slow
        uploads cannot hold the slots; beyond the limit the body's read raises a 429."""
        state, taken = self._state, False

        async def receive_within_limit() -> Message:
            nonlocal taken
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and not taken:
                if state.num_tokenizer_in_flight >= MAX_TOKENIZER_IN_FLIGHT:
                    state.metrics.record_rejection("tokenizer_busy")
                    raise too_many_requests(f"too many /tokenize and /detokenize requests in flight: "
                                            f"the limit is {MAX_TOKENIZER_IN_FLIGHT}", "tokenizer_busy")
                state.num_tokenizer_in_flight += 1
                taken = True
            return message

        try:
            await self.app(scope, receive_within_limit, send)
        finally:
            if taken:
                state.num_tokenizer_in_flight -= 1


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`: at once when Content-Length says so, else as soon
    as the bytes received pass the limit (a chunked upload), never buffering beyond it."""

    def __init__(self, app: ASGIApp, state: ServerState, max_bytes: int) -> None:
        self.app = app
        self._state = state
        self._max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self._max_bytes:
            too_large = self._too_large(f"Content-Length is {int(declared)} bytes and the limit is")
            await too_large.response()(scope, receive, send)
            return
        num_received = 0

        async def receive_within_limit() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self._max_bytes:  # the route's body read raises: a 413 body
                    raise self._too_large("it is longer than the limit of")
            return message

        await self.app(scope, receive_within_limit, send)

    def _too_large(self, what: str) -> APIError:
        self._state.metrics.record_rejection("max_request_body_bytes")
        return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"the request body is too large: {what} {self._max_bytes} bytes "
                        f"(--max-request-body-size)", "invalid_request_error", None,
                        "request_too_large")


class ClientStalled(Exception):
    """A response write still waited for the client at the client timeout."""


class _EndedOnPurpose(logging.Filter):
    """uvicorn's ERROR for a response the app left unfinished: SlowClientMiddleware does that on
    purpose to a stalled client, and logs why itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing response."


_ENDED_ON_PURPOSE = _EndedOnPurpose()


class SlowClientMiddleware:
    """A request's body must arrive within `timeout_s` of its headers (else 408), and a response
    write that cannot be handed to the connection within `timeout_s` ends the response, which
    aborts its request. uvicorn holds a write back while more than its high-water mark (64 KiB)
    waits unsent, until the client has taken about 48 KiB, so a client reading less than that per
    `timeout_s` (a stalled one: the socket's buffers are full) is cut off: 0.8 KB/s at the
    default 60 s. Without these a client that sends its body slowly, or stops reading, would hold
    its admission slot (and its seat) indefinitely."""

    def __init__(self, app: ASGIApp, state: ServerState, timeout_s: float) -> None:
        self.app = app
        self._state = state
        self._timeout_s = timeout_s
        logging.getLogger("uvicorn.error").addFilter(_ENDED_ON_PURPOSE)  # once: the same filter object

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self._timeout_s
        body_done = False

        async def receive_in_time() -> Message:
            nonlocal body_done
            if body_done:  # after the body only a disconnect comes: no deadline
                return await receive()
            try:
                message = await _within(receive(), deadline - time.monotonic())
            except TimeoutError:
                self._state.metrics.record_rejection("client_timeout")
                raise APIError(HTTPStatus.REQUEST_TIMEOUT, f"the request body did not arrive within "
                               f"{self._timeout_s:g} s (--client-timeout)", "invalid_request_error",
                               None, "client_timeout") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def send_in_time(message: Message) -> None:
            try:
                await _within(send(message), self._timeout_s)
            except TimeoutError:
                raise ClientStalled() from None

        try:
            await self.app(scope, receive_in_time, send_in_time)
        except ClientStalled:
            logger.warning("%s %s: a response write waited %g s for the client (--client-timeout); its "
                           "response ends here and its request is aborted", scope["method"], scope["path"],
                           self._timeout_s)


async def _within(step: Awaitable[T], timeout_s: float) -> T:
    """`step`, or TimeoutError after timeout_s: a timer on this task, not a task per call."""
    async with asyncio.timeout(max(0.0, timeout_s)):
        return await step
