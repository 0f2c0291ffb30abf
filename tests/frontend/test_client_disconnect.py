"""A client that goes away mid-request makes the frontend abort the request in the scheduler."""

from __future__ import annotations

import asyncio
import json

import pytest

from frontend.app import create_app

pytestmark = pytest.mark.anyio


def http_scope(path: str, spec_version: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 5000),
            "server": ("conveyor.test", 80)}


class LeavingClient:
    """ASGI receive/send of a client that hangs up once `leave` is set."""

    def __init__(self, body: dict) -> None:
        self.leave = asyncio.Event()
        self.chunks: list[bytes] = []
        self.status: int | None = None  # from http.response.start, once sent
        self._body = json.dumps(body).encode()

    async def receive(self) -> dict:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        await asyncio.sleep(0)  # a real socket write lets other tasks run
        if message["type"] == "http.response.start":
            self.status = message["status"]
        if message["type"] == "http.response.body" and message.get("body"):
            self.chunks.append(message["body"])


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_client_leaving_a_stream_aborts_the_request(config, engine, tokenizer, spec_version):
    engine.hang = True  # the engine sends the reply but never finishes on its own
    app = create_app(config, engine, tokenizer)
    client = LeavingClient({"prompt": "x", "max_tokens": 50, "stream": True})
    serving = asyncio.create_task(app(http_scope("/v1/completions", spec_version),
                                      client.receive, client.send))
    while not client.chunks:
        await asyncio.sleep(0.01)
    assert engine.aborted == []
    client.leave.set()
    await asyncio.wait_for(serving, timeout=5)
    assert engine.aborted == [engine.added[0].request_id]
    assert app.state.conveyor.num_in_flight == 0


async def test_client_leaving_a_non_streaming_request_aborts_it(config, engine, tokenizer):
    engine.hang = True
    app = create_app(config, engine, tokenizer)
    client = LeavingClient({"messages": [{"role": "user", "content": "hi"}]})
    serving = asyncio.create_task(app(http_scope("/v1/chat/completions", "2.3"),
                                      client.receive, client.send))
    while not engine.added:
        await asyncio.sleep(0.01)
    client.leave.set()
    await asyncio.wait_for(serving, timeout=5)
    assert engine.aborted == [engine.added[0].request_id]
    assert app.state.conveyor.num_in_flight == 0


async def test_finished_request_is_not_aborted(client, engine):
    await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    await client.post("/v1/completions", json={"prompt": "x"})
    assert engine.aborted == []


async def test_client_leaving_before_the_engine_is_asked_sends_nothing_to_the_engine(
        config, engine, tokenizer):
    app = create_app(config, engine, tokenizer)
    client = LeavingClient({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    client.leave.set()  # gone before the first chunk (the role) has even been sent
    await asyncio.wait_for(app(http_scope("/v1/chat/completions", "2.4"), client.receive, client.send), 5)
    assert engine.added == [] and engine.aborted == []


async def test_client_leaving_a_stream_while_it_waits_to_be_queued_aborts_it_and_sends_no_byte(
        config, engine, tokenizer):
    engine.hold = True  # the scheduler has not said "queued" yet: no status line can go out
    app = create_app(config, engine, tokenizer)
    client = LeavingClient({"prompt": "x", "stream": True})
    serving = asyncio.create_task(app(http_scope("/v1/completions", "2.4"), client.receive, client.send))
    while not engine.added:
        await asyncio.sleep(0.01)
    client.leave.set()
    await asyncio.wait_for(serving, timeout=5)
    assert engine.aborted == [engine.added[0].request_id]
    assert app.state.conveyor.num_in_flight == 0 and not app.state.conveyor.active


async def test_a_stream_sends_its_status_line_only_once_the_scheduler_has_queued_it(
        config, engine, tokenizer):
    engine.hold = True
    app = create_app(config, engine, tokenizer)
    client = LeavingClient({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    serving = asyncio.create_task(app(http_scope("/v1/chat/completions", "2.4"),
                                      client.receive, client.send))
    while not engine.added:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert client.status is None  # a refusal could still come: no 200 yet
    engine.release_held()
    while b"[DONE]" not in b"".join(client.chunks):
        await asyncio.sleep(0.01)
    assert client.status == 200 and b" capital" in b"".join(client.chunks)
    client.leave.set()
    await asyncio.wait_for(serving, timeout=5)


async def test_a_client_leaving_halfway_through_its_body_is_one_quiet_log_line(config, engine, tokenizer, caplog):
    app = create_app(config, engine, tokenizer)
    messages = iter([{"type": "http.request", "body": b'{"prompt": "The cap', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive() -> dict:
        return next(messages)

    async def send(message: dict) -> None:
        pass

    with caplog.at_level("INFO"):
        await asyncio.wait_for(app(http_scope("/v1/completions", "2.3"), receive, send), timeout=5)
    assert engine.added == [] and app.state.conveyor.num_in_flight == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
    assert "client left while sending POST /v1/completions" in caplog.text
