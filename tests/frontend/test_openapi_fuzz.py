"""schemathesis over /openapi.json: every route, with bodies that fit the schema and bodies that do
not, gets an answer below 500 (an OpenAI error body for every 4xx), within a bound, every time.

Hypothesis drives schemathesis's strategies directly (one test per route and mode), since its
pytest plugin does not run under pytest 9; the fake engine answers at once, so only the HTTP
layer is fuzzed here.
"""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from frontend.app import create_app

MAX_EXAMPLES = 40  # per route and mode: about 10 s for the whole file on 2 cores
MAX_RESPONSE_S = 2.0  # generous for a loaded CI machine: an answer, never a hang
BODY_ROUTES = ["POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"]
PLAIN_ROUTES = ["GET /v1/models", "GET /v1/models/{model}", "GET /health", "GET /ping", "POST /ping", "GET /metrics",
                "GET /version"]
ROUTES = BODY_ROUTES + PLAIN_ROUTES
CASES = [(route, mode) for route in BODY_ROUTES for mode in GenerationMode] + [
    (route, GenerationMode.POSITIVE) for route in PLAIN_ROUTES]


def test_the_fuzzed_routes_are_every_route_of_the_schema(config, engine, tokenizer):
    document = create_app(config, engine, tokenizer).openapi()
    labels = {f"{method.upper()} {path}" for path, item in document["paths"].items() for method in item}
    assert labels == set(ROUTES)


def test_the_schema_documents_every_request_model_and_its_fields(config, engine, tokenizer):
    document = create_app(config, engine, tokenizer).openapi()
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    models = document["components"]["schemas"]
    assert {"top_k", "logit_bias", "response_format", "messages"} <= set(
        models["ChatCompletionRequest"]["properties"])
    assert models["ChatMessage"]["properties"]["role"]["enum"] == [
        "system", "developer", "user", "assistant", "tool", "function"]
    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        assert "requestBody" in document["paths"][path]["post"], path


@pytest.mark.parametrize(("route", "mode"), CASES, ids=[f"{r} {m.value}" for r, m in CASES])
def test_no_generated_request_gets_a_5xx_or_hangs(config, engine, tokenizer, route, mode):
    # A long context lets more generated requests through validation to the engine.
    app = create_app(config.with_updates(max_model_len=1 << 20), engine, tokenizer)
    operation = schemathesis.openapi.from_asgi("/openapi.json", app).find_operation_by_label(route)
    assert operation is not None, route

    @given(case=operation.as_strategy(generation_mode=mode).map(_served_model))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: schemathesis.Case) -> None:
        started_s = time.monotonic()
        response = case.call()
        elapsed_s = time.monotonic() - started_s
        assert response.status_code < 500, (response.status_code, response.text[:500])
        assert elapsed_s < MAX_RESPONSE_S, f"{route} took {elapsed_s:.2f} s"
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"], error

    try:
        check()
    finally:
        app.state.conveyor.prepare_pool.shutdown(wait=True)


def _served_model(case: schemathesis.Case) -> schemathesis.Case:
    """The model's name is the deployment's choice, not a field to fuzz: a random one is a 404."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "tiny"
    return case
