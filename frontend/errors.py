"""OpenAI-shaped error responses: every failure the HTTP layer reports goes through `APIError`."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from proto.errors import ValidationError

logger = logging.getLogger(__name__)
_UNION_TAGS = frozenset({"str", "int", "float", "bool"})
# A queue full now has room within about a step or two; clients (OpenAI's among them) wait this long.
RETRY_AFTER_S = 1
# A 503's Retry-After: a replaced scheduler or worker group serves again within a few seconds
# (docs/benchmarks.md "Worker recovery time": 2-6 s); a draining server's successor, if any, likewise.
UNAVAILABLE_RETRY_AFTER_S = 5
# The scheduler's refusal codes (proto ERROR_CODES): a full queue -> the limit that refused (429),
# and a request that can never run as asked (400). A refused request never ran: it is not counted
# as a finished request (a 429 counts in request_rejected_total; a 400, like the frontend's own
# validation errors, in neither).
QUEUE_LIMIT_OF_ERROR_CODE = {"queue_full": "max_num_waiting", "waiting_tokens_full": "max_waiting_tokens"}
INVALID_REQUEST_ERROR_CODE = "invalid_request"
REFUSAL_ERROR_CODES = frozenset({*QUEUE_LIMIT_OF_ERROR_CODE, INVALID_REQUEST_ERROR_CODE})


class APIError(Exception):
    """An error with its HTTP status and the fields of OpenAI's error body."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(HTTPStatus.BAD_REQUEST, message, "invalid_request_error", param, code)


def too_many_requests(message: str, code: str = "queue_full") -> APIError:
    """429 with OpenAI's rate-limit body and a Retry-After, which OpenAI's clients honour."""
    return APIError(HTTPStatus.TOO_MANY_REQUESTS, message, "rate_limit_error", None, code,
                    {"Retry-After": str(RETRY_AFTER_S)})


def unavailable(message: str, code: str | None = None) -> APIError:
    """503 with a Retry-After: the server cannot run requests now (draining, or a process of it
    being replaced); OpenAI's clients retry a 503 and wait as long as Retry-After says."""
    return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, "server_error", None, code,
                    {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})


def from_validation_error(exc: ValidationError) -> APIError:
    return bad_request(exc.message, exc.param)


# The JSON parser's words for a high surrogate escape not followed by a low one, and for a low one
# alone (Python's json module takes both; no tokenizer can encode the string they make).
_LONE_SURROGATE = ("unexpected end of hex escape", "lone leading surrogate in hex escape")


def describe_pydantic_errors(errors: list[dict[str, Any]]) -> APIError:
    """One readable 400 from pydantic/FastAPI error dicts: the first problem, its place, its input."""
    first = errors[0]
    # Union members add their type to the location ("stop.list[str]"); the client only needs the field.
    location = [str(part) for part in first.get("loc", ())
                if part != "body" and part not in _UNION_TAGS and "[" not in str(part)]
    param = ".".join(location) or None
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        for parser_says in _LONE_SURROGATE:  # its words name the escape's end, not what is wrong
            if detail.startswith(parser_says):
                detail = ("a \\uD800-\\uDFFF escape must be half of a surrogate pair (a lone surrogate is "
                          "not a Unicode character)" + detail[len(parser_says):])
        return bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "))
    if param is None and first.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        return bad_request("the request body must be a JSON object")
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    if isinstance(first.get("input"), (str, int, float, bool)):
        message += f", got {_shown(first['input'])}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return bad_request(message, param)


def _shown(value: object) -> str:
    """A client's value in a message: short, whatever its size (a 10^4-digit int, a 1 MB string)."""
    try:
        text = json.dumps(value)
    except ValueError:  # an int past Python's 4300-digit str() limit
        return "a number too large to show"
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's 422 and plain-text errors with OpenAI bodies; nothing escapes as a crash."""

    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return describe_pydantic_errors(list(exc.errors())).response()

    async def on_proto_validation(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(exc.status_code, str(exc.detail), kind)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    async def on_client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client left while sending its body: no one to answer, nothing to log but a line.
        logger.info("client left while sending %s %s", request.method, request.url.path)
        return Response(status_code=HTTPStatus.BAD_REQUEST)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving %s %s", request.method, request.url.path)
        return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc}",
                        "server_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(ValidationError, on_proto_validation)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(Exception, on_unexpected)
