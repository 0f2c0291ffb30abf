"""Connections that misbehave, over real TCP on loopback: huge bodies, early refusals, clients that
vanish, idle or read slowly. Each gets its answer (or works) and the next client is served."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from live_server import LiveServer, raw_request, read_response_head

from frontend.admission import MAX_TOKENIZER_IN_FLIGHT
from frontend.app import create_app

FIFTY_MB = 50 << 20
NUM_IDLE_CONNECTIONS = 200  # the 1,000 is more than 2 shared cores should hold for a test


@pytest.fixture
def live(config, engine, tokenizer) -> Iterator[LiveServer]:
    with LiveServer(create_app(config, engine, tokenizer)) as server:
        yield server


def served_quickly(url: str) -> None:
    """A completion and /health each answer within a second."""
    for method, path, body in (("POST", "/v1/completions", {"prompt": "x"}), ("GET", "/health", None)):
        started_s = time.monotonic()
        response = httpx.request(method, url + path, json=body, timeout=5)
        assert response.status_code == 200, response.text
        assert time.monotonic() - started_s < 1.0, path


def wait_until(condition, timeout_s: float = 30.0) -> None:
    """Polls until condition holds; the deadline only bounds a hang (a loaded 2-core CI machine has
    taken over 5 s to tokenize and add two requests)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_50_mb_body_is_refused_with_413_from_its_length_alone(live):
    with live.connect() as sock:
        started_s = time.monotonic()
        sock.sendall(raw_request("/v1/completions", b"", content_length=FIFTY_MB))  # no body sent
        status, headers, rest = read_response_head(sock)
        assert time.monotonic() - started_s < 1.0
    assert status == 413 and headers["content-type"] == "application/json"
    assert b"Content-Length is 52428800 bytes" in rest
    response = httpx.post(live.url + "/v1/completions", content=b"x" * FIFTY_MB, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413
    served_quickly(live.url)


def test_a_full_queue_refuses_before_reading_the_body(config, engine, tokenizer):
    engine.hang = True
    app = create_app(config.with_updates(max_num_seqs=1, max_num_waiting=1), engine, tokenizer)
    with LiveServer(app) as server, server.connect() as first, server.connect() as second:
        for sock in (first, second):
            sock.sendall(raw_request("/v1/completions", b'{"prompt": "x"}'))
        wait_until(lambda: len(engine.added) == 2)
        with server.connect() as third:
            started_s = time.monotonic()
            third.sendall(raw_request("/v1/completions", b"", content_length=4000))  # body withheld
            status, headers, rest = read_response_head(third)
            # Far under the body read's deadline (client_timeout_s, 60 s): the body was never awaited.
            assert time.monotonic() - started_s < 5.0
        assert status == 429 and headers["retry-after"] == "1"
        assert b'"type":"rate_limit_error"' in rest and b"the limit is 2" in rest


class Lines(logging.Handler):
    """The messages one logger emits (uvicorn reconfigures logging as each server starts, so
    pytest's caplog does not see them all)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_stream_whose_client_vanishes_before_the_first_byte_leaves_nothing_running(
        config, engine, tokenizer):
    engine.hang = True  # only an abort can end these requests
    app = create_app(config, engine, tokenizer)
    body = json.dumps({"prompt": "x", "stream": True, "max_tokens": 50}).encode()
    with LiveServer(app) as server:
        for _ in range(5):
            with server.connect() as sock:
                sock.sendall(raw_request("/v1/completions", body))
        state = app.state.conveyor
        wait_until(lambda: state.num_in_flight == 0 and not state.active)
        assert sorted(engine.aborted) == sorted(r.request_id for r in engine.added)
        engine.hang = False
        served_quickly(server.url)


def test_many_idle_keep_alive_connections_do_not_slow_other_clients(live):
    idle: list[socket.socket] = []
    try:
        for index in range(NUM_IDLE_CONNECTIONS):
            sock = live.connect()
            idle.append(sock)
            if index % 2:  # half served once and kept alive, half never say a word
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert read_response_head(sock)[0] == 200
        served_quickly(live.url)
        for sock in idle[1:20:2]:  # a kept-alive connection still serves its next request
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_response_head(sock)[0] == 200
    finally:
        for sock in idle:
            sock.close()


def test_a_client_reading_its_stream_slowly_gets_all_of_it_and_others_are_served(
        config, engine, tokenizer):
    engine.reply_token_ids = engine.reply_token_ids * 100  # about 800 SSE events
    app = create_app(config.with_updates(max_model_len=4096), engine, tokenizer)
    body = json.dumps({"prompt": "x", "stream": True, "max_tokens": 2000}).encode()
    with LiveServer(app) as server:
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills at once
        slow.connect(("127.0.0.1", server.port))
        with slow:
            slow.sendall(raw_request("/v1/completions", body))
            received = b""
            for _ in range(40):  # a byte every 10 ms while others come and go
                received += slow.recv(1)
                time.sleep(0.01)
            served_quickly(server.url)
            slow.settimeout(10)
            while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                chunk = slow.recv(65536)
                assert chunk, "the stream ended early"
                received += chunk
    assert received.startswith(b"HTTP/1.1 200") and received.count(b"data: {") > 700


def test_a_body_that_does_not_arrive_within_the_client_timeout_gets_408_and_frees_its_slot(
        config, engine, tokenizer):
    app = create_app(config.with_updates(max_num_seqs=1, max_num_waiting=1, client_timeout_s=1.0),
                     engine, tokenizer)
    state = app.state.conveyor
    with LiveServer(app) as server, server.connect() as first, server.connect() as second:
        for sock in (first, second):  # both admission slots, each body 5 bytes of 66
            sock.sendall(raw_request("/v1/completions", b'{"pro', content_length=66))
        wait_until(lambda: state.num_in_flight == 2)
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=5).status_code == 429
        started_s = time.monotonic()
        for sock in (first, second):
            status, _, rest = read_response_head(sock)
            assert status == 408 and json.loads(rest)["error"]["code"] == "client_timeout"
            assert b"did not arrive within 1 s (--client-timeout)" in rest
        assert time.monotonic() - started_s < 3.0
        wait_until(lambda: state.num_in_flight == 0)
        assert not engine.added  # neither ever reached the engine
        served_quickly(server.url)


def test_a_stream_whose_client_stops_reading_is_ended_and_aborted_after_the_client_timeout(
        config, engine, tokenizer):
    # About 8 MB of events, more than the sockets' buffers hold; the request never ends on its own.
    engine.reply_token_ids, engine.hang = engine.reply_token_ids * 1000, True
    app = create_app(config.with_updates(max_model_len=16384, client_timeout_s=1.0), engine, tokenizer)
    state = app.state.conveyor
    body = json.dumps({"prompt": "x", "stream": True, "max_tokens": 9000, "logprobs": 20}).encode()
    with LiveServer(app) as server:
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", server.port))
        with stalled:
            uvicorn_log, lines = logging.getLogger("uvicorn.error"), Lines()
            uvicorn_log.addHandler(lines)
            try:
                stalled.sendall(raw_request("/v1/completions", body))  # and never reads a byte
                wait_until(lambda: engine.added)
                started_s = time.monotonic()
                wait_until(lambda: state.num_in_flight == 0, timeout_s=15)
                assert time.monotonic() - started_s > 0.9  # it stalled first, then the timeout ran out
                time.sleep(0.2)
            finally:
                uvicorn_log.removeHandler(lines)
            assert not [line for line in lines.lines if "without completing response" in line]  # on purpose
            assert engine.aborted == [engine.added[0].request_id]
            engine.hang = False
            served_quickly(server.url)


def test_tokenizer_requests_beyond_their_limit_get_429_and_slow_uploads_hold_no_slot(live):
    state = live.app.state.conveyor
    release = threading.Event()
    prepare = state.prepare

    async def held_prepare(work):  # each tokenization waits until released
        await asyncio.get_running_loop().run_in_executor(None, release.wait)
        return await prepare(work)

    state.prepare = held_prepare
    slow = [live.connect() for _ in range(MAX_TOKENIZER_IN_FLIGHT)]
    try:
        for sock in slow:  # bodies still arriving take no slot
            sock.sendall(raw_request("/detokenize", b'{"tok', content_length=4000))
        with ThreadPoolExecutor(MAX_TOKENIZER_IN_FLIGHT) as pool:
            held = [pool.submit(httpx.post, live.url + "/tokenize", json={"prompt": "hi"}, timeout=10)
                    for _ in range(MAX_TOKENIZER_IN_FLIGHT)]
            wait_until(lambda: state.num_tokenizer_in_flight == MAX_TOKENIZER_IN_FLIGHT)
            refused = httpx.post(live.url + "/tokenize", json={"prompt": "hi"}, timeout=5)
            assert (refused.status_code, refused.json()["error"]["code"]) == (429, "tokenizer_busy")
            assert httpx.get(live.url + "/health", timeout=5).status_code == 200
            release.set()
            assert [future.result().status_code for future in held] == [200] * MAX_TOKENIZER_IN_FLIGHT
    finally:
        release.set()
        for sock in slow:
            sock.close()
    wait_until(lambda: state.num_tokenizer_in_flight == 0)
    assert httpx.post(live.url + "/tokenize", json={"prompt": "hi"}, timeout=5).status_code == 200


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="no TCP_USER_TIMEOUT on this OS")
def test_accepted_connections_are_closed_by_the_kernel_after_the_client_timeout_unacknowledged():
    from frontend.server import bind_listen_socket

    with bind_listen_socket("127.0.0.1", 0, client_timeout_s=2.5) as listener:
        listener.listen()
        with socket.create_connection(listener.getsockname()), listener.accept()[0] as accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2500
