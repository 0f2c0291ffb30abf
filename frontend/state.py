"""The frontend process's state: one explicit object shared by every route."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi import Request

from frontend.engine_client import EngineClient
from frontend.errors import APIError
from frontend.generation import Generation
from frontend.metrics import FrontendMetrics
from frontend.tokenizer import Tokenizer
from frontend.validation import ModelLimits
from proto.config import EngineConfig


@dataclass
class ServerState:
    """Owned by the app; `draining` flips once on SIGTERM and never back."""

    config: EngineConfig
    engine: EngineClient
    tokenizer: Tokenizer
    metrics: FrontendMetrics
    limits: ModelLimits
    model_name: str
    max_in_flight: int  # the frontend's own admission limit (429 beyond it)
    draining: bool = False
    created_s: int = field(default_factory=lambda: int(time.time()))
    active: set[Generation] = field(default_factory=set)

    @property
    def num_in_flight(self) -> int:
        return len(self.active)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.config.model):
            raise APIError(HTTPStatus.NOT_FOUND,
                           f"The model `{name}` does not exist. This server serves: `{self.model_name}`",
                           "invalid_request_error", "model", "model_not_found")

    def check_admission(self) -> None:
        """503 while draining or without a live scheduler, 429 at the in-flight limit."""
        if self.draining:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down",
                           "server_error", None, "draining")
        if not self.engine.is_alive():
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE,
                           "the engine is not available (no recent message from the scheduler)",
                           "server_error", None, "engine_unavailable")
        if self.num_in_flight >= self.max_in_flight:
            raise APIError(HTTPStatus.TOO_MANY_REQUESTS,
                           f"too many requests in flight: the limit is {self.max_in_flight}",
                           "rate_limit_error", None, "queue_full")

    @contextlib.contextmanager
    def track_request(self, generation: Generation) -> Iterator[None]:
        self.active.add(generation)
        try:
            yield
        finally:
            self.active.discard(generation)

    def abort_all(self, message: str) -> None:
        """End every in-flight request now (each still gets its terminal response)."""
        for generation in list(self.active):
            generation.abort(message)


def get_state(request: Request) -> ServerState:
    return request.app.state.conveyor
