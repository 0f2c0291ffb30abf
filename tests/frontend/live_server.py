"""The frontend app under a real uvicorn on a loopback socket, in a thread: for what needs TCP."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 (a free port) from a daemon thread; a context manager."""

    def __init__(self, app: FastAPI, timeout_keep_alive_s: int = 30) -> None:
        self.app = app
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=timeout_keep_alive_s,
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True, name="live-uvicorn")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start within 10 s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)


def raw_request(path: str, body: bytes, content_length: int | None = None,
                extra_headers: str = "") -> bytes:
    """An HTTP/1.1 POST as bytes; `content_length` may claim more than `body` holds."""
    length = len(body) if content_length is None else content_length
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra_headers}\r\n")
    return head.encode() + body


def read_response_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and the body: all of it when it has a Content-Length,
    else whatever came with the head."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full response head: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in header_lines)}
    while len(rest) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the whole body")
        rest += chunk
    return int(status_line.split()[1]), headers, rest
