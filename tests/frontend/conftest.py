"""Frontend test fixtures: the tiny tokenizer, a fake engine and app client, a fake scheduler thread."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import zmq

if str(Path(__file__).resolve().parent) not in sys.path:  # frontend_fakes under importlib mode
    sys.path.append(str(Path(__file__).resolve().parent))  # appended: never shadows `frontend`

from frontend_fakes import FakeEngineClient  # noqa: E402

from frontend.app import create_app
from frontend.tokenizer import Tokenizer
from proto import codec, sockets
from proto.config import EngineConfig
from proto.messages import AddRequest, FrontendHello, SchedulerStats, StepOutputs

REPLY_TEXT = "Paris is the capital of France."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def reply_text() -> str:
    return REPLY_TEXT


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture
def engine(tokenizer: Tokenizer) -> FakeEngineClient:
    return FakeEngineClient(tokenizer.encode(REPLY_TEXT, add_special_tokens=False))


@pytest.fixture
def config(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), served_model_name="tiny", max_model_len=128,
                        vocab_size=512)


def make_client(config: EngineConfig, engine: FakeEngineClient, tokenizer: Tokenizer) -> httpx.AsyncClient:
    app = create_app(config, engine, tokenizer)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://conveyor.test")


@pytest.fixture
async def client(config: EngineConfig, engine: FakeEngineClient,
                 tokenizer: Tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(config, engine, tokenizer) as http:
        yield http


@pytest.fixture
def make_http(engine: FakeEngineClient, tokenizer: Tokenizer) -> Callable[[EngineConfig], httpx.AsyncClient]:
    """An HTTP client for an app built from another config (same fake engine)."""
    return lambda config: make_client(config, engine, tokenizer)


def parse_sse(body: str) -> tuple[list[dict], bool]:
    """The JSON events of an SSE body and whether it ended with `data: [DONE]`."""
    events = [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    return [json.loads(e) for e in events if e != "[DONE]"], done


@pytest.fixture
def sse() -> Callable[[str], tuple[list[dict], bool]]:
    return parse_sse


def step_outputs(request_ids: list[str], tokens: list[list[int]], finish_reasons: list[str],
                 step_id: int = 1) -> StepOutputs:
    """A StepOutputs (step_id -1 with no requests is an idle heartbeat)."""
    lengths = [len(t) for t in tokens]
    return StepOutputs(
        step_id=step_id, request_ids=request_ids,
        cu_new_tokens=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        new_token_ids=np.array([t for ts in tokens for t in ts], dtype=np.int32),
        finish_reasons=finish_reasons, error_messages=[""] * len(request_ids),
        stats=SchedulerStats(num_running=len(request_ids), num_waiting=0, num_waiting_tokens=0,
                             kv_cache_usage=0.1, num_preemptions_total=0),
        step_duration_s=0.001, wall_time_s=time.time())


class FakeScheduler(threading.Thread):
    """Binds REQUESTS/OUTPUTS like the scheduler; answers an AddRequest after `answer_delay_s`
    with prompt[-1]+1, then prompt[-1]+2 and "length". A prompt starting with token 0 is never
    answered (to test aborts). With `heartbeats` off it is silent when idle.
    """

    def __init__(self, runtime_dir: str) -> None:
        super().__init__(daemon=True)
        self.received: list[object] = []  # requests and aborts
        self.hellos: list[FrontendHello] = []
        self.heartbeats = True
        self.answer_delay_s = 0.0
        self.stop = threading.Event()
        self._pending: list[tuple[float, str, int]] = []  # (due monotonic, request id, last token)
        self._context = zmq.Context()
        self._requests = sockets.bind(self._context, zmq.PULL, runtime_dir, sockets.REQUESTS)
        self._outputs = sockets.bind(self._context, zmq.PUSH, runtime_dir, sockets.OUTPUTS)

    def run(self) -> None:
        while not self.stop.is_set():
            frame = sockets.recv_ready(self._requests, 0.02)
            if frame is not None:
                self._on_message(codec.decode(frame, sockets.REQUEST_MESSAGES))
            elif self.heartbeats:
                self._send(codec.encode(step_outputs([], [], [], step_id=-1)))
            self._answer_due()
        self._requests.close()
        self._outputs.close()
        self._context.term()

    def _on_message(self, message: object) -> None:
        if isinstance(message, FrontendHello):
            self.hellos.append(message)
            return
        self.received.append(message)
        if isinstance(message, AddRequest) and message.prompt_token_ids[0] != 0:
            due = time.monotonic() + self.answer_delay_s
            self._pending.append((due, message.request_id, int(message.prompt_token_ids[-1])))

    def _answer_due(self) -> None:
        now = time.monotonic()
        for entry in [p for p in self._pending if p[0] <= now]:
            self._pending.remove(entry)
            _, request_id, last = entry
            self._send(b"\x93not a message")  # a malformed frame: counted, never fatal
            self._send(codec.encode(step_outputs([request_id], [[last + 1]], [""])))
            self._send(codec.encode(step_outputs([request_id], [[last + 2]], ["length"])))

    def _send(self, frame: bytes) -> None:
        try:  # without a connected client a blocking PUSH would hang this thread forever
            self._outputs.send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass


@pytest.fixture
def runtime_dir() -> Iterator[str]:
    path = sockets.make_runtime_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake_scheduler(runtime_dir: str) -> Iterator[FakeScheduler]:
    scheduler = FakeScheduler(runtime_dir)
    scheduler.start()
    yield scheduler
    scheduler.stop.set()
    scheduler.join(timeout=5)
