"""The FastAPI application factory: state, routes, OpenAI errors, CORS, API key check, engine lifespan."""

from __future__ import annotations

import contextlib
import hmac
import json
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.admission import AdmissionMiddleware, BodyLimitMiddleware, SlowClientMiddleware
from frontend.engine_client import EngineClient
from frontend.errors import APIError, install_error_handlers
from frontend.grammar_check import BackgroundGrammarChecker, GrammarChecker
from frontend.http_metrics import HttpMetricsMiddleware
from frontend.metrics import FrontendMetrics
from frontend.openapi import install_openapi
from frontend.routes import chat, completions, misc
from frontend.state import ServerState
from frontend.tokenizer import Tokenizer
from frontend.tool_parsers import ToolParser, choose_tool_parser
from frontend.validation import ModelLimits
from proto.config import EngineConfig


def create_app(config: EngineConfig, engine_client: EngineClient,
               tokenizer: Tokenizer | None = None) -> FastAPI:
    """Build the app; the engine client is started and closed by the app's lifespan."""
    tokenizer = tokenizer or Tokenizer.from_dir(config.model)
    # The supervisor resolved the model's facts into the config: nothing is read again here.
    model_name = config.served_model_name
    limits = ModelLimits(max_model_len=config.max_model_len, vocab_size=config.vocab_size)
    metrics = FrontendMetrics(model_name, max_num_seqs=config.max_num_seqs,
                              max_model_len=limits.max_model_len,
                              max_num_batched_tokens=config.max_num_batched_tokens)
    metrics.record_cache_config(config)
    engine_client.add_listener(metrics)
    state = ServerState(config=config, engine=engine_client, tokenizer=tokenizer,
                        metrics=metrics, limits=limits, model_name=model_name,
                        max_in_flight=config.max_num_seqs + config.max_num_waiting,
                        grammar_checker=_grammar_checker(config, tokenizer),
                        tool_parser=_tool_parser(config, tokenizer))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine_client.start()
        try:
            yield
        finally:
            await engine_client.close()
            state.prepare_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="conveyor", lifespan=lifespan)
    app.state.conveyor = state
    install_error_handlers(app)
    for module in (completions, chat, misc):
        app.include_router(module.router)
    install_openapi(app)
    # The last added runs first: the HTTP answer count, CORS (a browser's preflight is answered
    # before any check, and every answer, refusals too, carries its headers; not the 500 of an
    # unhandled error, which Starlette's outermost handler writes), the API key, slow clients'
    # deadlines, the body size, admission.
    app.add_middleware(AdmissionMiddleware, state=state)
    app.add_middleware(BodyLimitMiddleware, state=state, max_bytes=config.max_request_body_bytes)
    app.add_middleware(SlowClientMiddleware, state=state, timeout_s=config.client_timeout_s)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    route_paths = frozenset(route.path for module in (completions, chat, misc) for route in module.router.routes)
    app.add_middleware(HttpMetricsMiddleware, state=state, route_paths=route_paths)
    return app


def _grammar_checker(config: EngineConfig, tokenizer: Tokenizer) -> BackgroundGrammarChecker:
    """Built on a thread: the frontend reports ready without waiting for llguidance's token table."""
    eos_token_ids = config.eos_token_ids or tuple(
        token_id for token_id in (tokenizer.eos_token_id,) if token_id is not None)
    return BackgroundGrammarChecker(
        lambda: GrammarChecker.for_tokenizer(tokenizer, config.vocab_size, eos_token_ids))


def _tool_parser(config: EngineConfig, tokenizer: Tokenizer) -> ToolParser:
    """`--tool-call-parser`, or the one the model's chat template and family call for."""
    flag = None if config.tool_call_parser == "auto" else config.tool_call_parser
    try:
        model_type = json.loads((Path(config.model) / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError, AttributeError):
        model_type = ""
    return choose_tool_parser(flag, str(model_type), tokenizer.chat_template)


class ApiKeyMiddleware:
    """401 on /v1/* unless `Authorization: Bearer <api_key>`. Pure ASGI so streams are untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            error = APIError(HTTPStatus.UNAUTHORIZED, "invalid or missing API key: send "
                             "`Authorization: Bearer <key>`", "invalid_request_error", None,
                             "invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers", ()))
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        # The scheme is case-insensitive (RFC 7235); compare_digest: the comparison time must not
        # reveal how much of the key matched.
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self._expected)
