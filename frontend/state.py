"""The frontend process's state: one explicit object shared by every route."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TypeVar

from fastapi import Request

from frontend.engine_client import EngineClient
from frontend.errors import APIError, too_many_requests, unavailable
from frontend.generation import Generation
from frontend.grammar_check import GrammarCheck
from frontend.metrics import FrontendMetrics
from frontend.tokenizer import Tokenizer
from frontend.tool_parsers import HermesParser, ToolParser
from frontend.validation import ModelLimits
from proto.config import EngineConfig, beyond_free_seats, free_seats

NUM_PREPARE_THREADS = 2  # parsing, chat templates and tokenizing; the tokenizer lets go of the GIL

Result = TypeVar("Result")


@dataclass
class ServerState:
    """Owned by the app; `draining` flips once on SIGTERM and never back.

    `num_in_flight` counts generation requests from arrival (before their body is read) to the
    end of their response (AdmissionMiddleware); `active` holds those that have a Generation.
    """

    config: EngineConfig
    engine: EngineClient
    tokenizer: Tokenizer
    metrics: FrontendMetrics
    limits: ModelLimits
    model_name: str
    max_in_flight: int  # the frontend's own admission limit (429 beyond it)
    grammar_checker: GrammarCheck | None = None  # compile-checks output constraints before queueing
    tool_parser: ToolParser = field(default_factory=HermesParser)  # reads `auto` tool calls
    draining: bool = False
    created_s: int = field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0
    num_tokenizer_in_flight: int = 0  # /tokenize and /detokenize requests (AdmissionMiddleware)
    active: set[Generation] = field(default_factory=set)
    prepare_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        NUM_PREPARE_THREADS, thread_name_prefix="prepare"))

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.config.model):
            raise APIError(HTTPStatus.NOT_FOUND,
                           f"The model `{name}` does not exist. This server serves: `{self.model_name}`",
                           "invalid_request_error", "model", "model_not_found")

    def check_serving(self) -> None:
        """503 while draining or without a live scheduler."""
        if self.draining:
            self.metrics.record_rejection("draining")
            raise unavailable("the server is shutting down", "draining")
        if not self.engine.is_alive():
            self.metrics.record_rejection("engine_unavailable")
            raise unavailable("the engine is not available (no recent message from the scheduler)",
                              "engine_unavailable")

    def check_admission(self) -> None:
        """What can be known before a request's body is read: 503 (check_serving), or 429 when
        this frontend has max_in_flight requests or the scheduler last reported its waiting queue
        full by count or by prompt tokens. The exact token check is the scheduler's own."""
        self.check_serving()
        if self.num_in_flight >= self.max_in_flight:
            raise self._refused("max_num_waiting", f"too many requests in flight: the limit is "
                                f"{self.max_in_flight} (max_num_seqs + max_num_waiting)")
        stats, config = self.engine.latest_stats, self.config
        num_free_seats = 0 if stats is None else free_seats(config, stats.num_running, stats.workers_serving)
        if stats is not None and stats.num_waiting >= config.max_num_waiting + num_free_seats:
            raise self._refused("max_num_waiting", f"the waiting queue is full: {stats.num_waiting} "
                                f"sequences are waiting and max_num_waiting is {config.max_num_waiting} "
                                f"{beyond_free_seats(num_free_seats)}")
        if stats is not None and stats.num_waiting_tokens >= config.max_waiting_tokens:
            raise self._refused("max_waiting_tokens", f"the waiting queue is full: "
                                f"{stats.num_waiting_tokens} prompt tokens are waiting and "
                                f"max_waiting_tokens is {config.max_waiting_tokens}")

    async def prepare(self, work: Callable[[], Result]) -> Result:
        """Run CPU work for one request (parse, template, tokenize) off the event loop, so that
        /health, /metrics and other clients' streams are served meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, work)

    def abort_all(self, message: str) -> None:
        """End every in-flight request now (each still gets its terminal response)."""
        for generation in list(self.active):
            generation.abort(message)

    def _refused(self, limit: str, message: str) -> APIError:
        self.metrics.record_rejection(limit)
        return too_many_requests(message)


def get_state(request: Request) -> ServerState:
    return request.app.state.conveyor
