"""CORS: browser pages of the allowed origins may call the API; preflights are answered before any check."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.anyio

PREFLIGHT = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


async def test_any_origin_by_default_on_answers_streams_and_preflights(client, sse):
    preflight = await client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    stream = await client.post("/v1/completions", json={"prompt": "x", "stream": True},
                               headers={"Origin": "https://ui.example"})
    assert stream.headers["access-control-allow-origin"] == "*"
    assert sse(stream.text)[1]


async def test_a_preflight_needs_no_api_key_and_a_refusal_is_readable_by_the_page(config, make_http):
    async with make_http(config.with_updates(api_key="sesame")) as http:
        assert (await http.options("/v1/chat/completions", headers=PREFLIGHT)).status_code == 200
        refused = await http.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


async def test_only_the_listed_origins_are_allowed(config, make_http):
    async with make_http(config.with_updates(allowed_origins=("https://ui.example",))) as http:
        allowed = await http.options("/v1/chat/completions", headers=PREFLIGHT)
        assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
        other = await http.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        answer = await http.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


async def test_no_origins_means_no_cors_headers(config, make_http):
    async with make_http(config.with_updates(allowed_origins=())) as http:
        assert (await http.options("/v1/chat/completions", headers=PREFLIGHT)).status_code == 405
        answer = await http.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert "access-control-allow-origin" not in answer.headers
