"""Structured output through the real scheduler and worker processes (tiny model), at the AddRequest
level: the test plays the frontend on the requests/outputs sockets (the HTTP side is the frontend's).
Constrained rows, greedy and sampled, n > 1, next to an unconstrained one, each stop valid."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import zmq
from support import tiny_config

from deploy.launcher import Stack
from proto import codec, sockets
from proto.grammar import GrammarSpec
from proto.messages import AddRequest, StepOutputs
from proto.sampling import SamplingParams

SCHEMA = {"type": "object",
          "properties": {"role": {"enum": ["admin", "user"]}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3}},
          "required": ["role", "ok", "tags"], "additionalProperties": False}


class EngineStack(Stack):
    """The stack without its frontend process: the test is the frontend."""

    def _plan_children(self, gpus: list[str]) -> list:
        return [child for child in super()._plan_children(gpus) if child.name != "frontend"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    with EngineStack(tiny_config(tiny_model_dir), log_dir=tmp_path_factory.mktemp("logs")) as stack:
        context = zmq.Context()
        requests = sockets.connect(context, zmq.PUSH, stack.config.runtime_dir, sockets.REQUESTS)
        outputs = sockets.connect(context, zmq.PULL, stack.config.runtime_dir, sockets.OUTPUTS)
        try:
            yield requests, outputs
        finally:
            requests.close(0)
            outputs.close(0)
            context.term()


def run_all(engine: tuple[zmq.Socket, zmq.Socket], adds: list[AddRequest],
            timeout_s: float = 120.0) -> dict[tuple[str, int], tuple[list[int], str, str]]:
    """(tokens, finish reason, error message) of every choice of `adds`."""
    requests, outputs = engine
    for add in adds:
        requests.send(codec.encode(add))
    expected = {(add.request_id, index) for add in adds for index in range(add.sampling_params.n)}
    tokens: dict[tuple[str, int], list[int]] = {key: [] for key in expected}
    finished: dict[tuple[str, int], tuple[str, str]] = {}
    deadline = time.monotonic() + timeout_s
    while len(finished) < len(expected) and time.monotonic() < deadline:
        frame = sockets.recv_ready(outputs, 1.0)
        if frame is None:
            continue
        message = codec.decode(frame, StepOutputs)
        choices = message.choice_indices.tolist() or [0] * message.num_outputs
        for index, (request_id, choice) in enumerate(zip(message.request_ids, choices)):
            key = (request_id, choice)
            if key in expected:
                tokens[key].extend(message.tokens_of(index).tolist())
                if message.finish_reasons[index]:
                    finished[key] = (str(message.finish_reasons[index]), message.error_messages[index])
    assert len(finished) == len(expected), f"unfinished: {expected - set(finished)}"
    return {key: (tokens[key], *finished[key]) for key in expected}


def test_constrained_requests_stop_valid_next_to_an_unconstrained_one(
        engine: tuple[zmq.Socket, zmq.Socket], tiny_model_dir: Path) -> None:
    tokenizer = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    prompt = np.array(tokenizer.encode("The quick brown fox").ids, dtype=np.int32)
    spec, now = GrammarSpec.json_schema(SCHEMA), time.time()
    adds = [AddRequest("greedy", prompt, SamplingParams(max_tokens=150, temperature=0.0), now, spec),
            AddRequest("sampled", prompt, SamplingParams(max_tokens=150, temperature=1.0, seed=3, n=2,
                                                         logprobs=3), now, spec),
            AddRequest("choice", prompt, SamplingParams(max_tokens=20, ignore_eos=True), now,
                       GrammarSpec.choice(["yes", "no"])),
            AddRequest("free", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), now),
            AddRequest("bad", prompt, SamplingParams(max_tokens=5), now, GrammarSpec("regex", "(unclosed"))]
    results = run_all(engine, adds)
    for key in (("greedy", 0), ("sampled", 0), ("sampled", 1)):
        token_ids, reason, error = results[key]
        assert reason == "stop", (key, reason, error)
        document = json.loads(tokenizer.decode(token_ids))
        assert list(document) == ["role", "ok", "tags"] and document["role"] in ("admin", "user")
        assert isinstance(document["ok"], bool) and all(tag in ("a", "bc") for tag in document["tags"])
    assert results[("choice", 0)][1] == "stop" and tokenizer.decode(results[("choice", 0)][0]) in ("yes", "no")
    assert results[("free", 0)][1] == "length" and len(results[("free", 0)][0]) == 12
    assert results[("bad", 0)][1] == "error" and "does not compile" in results[("bad", 0)][2]
