"""Hypothesis strategies for frames from anywhere: random bytes, truncated frames, MessagePack of
the wrong shape, forged huge length prefixes, wrong-length arrays, other channels' messages."""

from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import strategies as st

from proto import codec, control, messages
from proto.errors import ProtocolError
from proto.logprobs import LogprobEntries
from proto.sampling import SamplingParams
from proto.sampling_columns import SamplingColumns

I32, F32 = np.int32, np.float32


def step_plan(step_id: int, request_ids: list[str], num_computed: list[int],
              block_ids: list[list[int]]) -> messages.StepPlan:
    """A greedy plan: member i decodes one token at position num_computed[i] (token 3) with the
    block table block_ids[i]."""
    n = len(request_ids)
    cu_block_ids = np.cumsum([0] + [len(blocks) for blocks in block_ids]).astype(I32)
    return messages.StepPlan(
        step_id=step_id, request_ids=request_ids, input_ids=np.full(n, 3, I32),
        num_computed_tokens=np.asarray(num_computed, I32), num_scheduled_tokens=np.ones(n, I32),
        cu_block_ids=cu_block_ids, block_ids=np.asarray(sum(block_ids, []), I32),
        sample_mask=np.ones(n, bool),
        sampling=SamplingColumns.of_params([SamplingParams(temperature=0.0)] * n, seeds=range(n)))


def valid_messages() -> list[object]:
    """One small valid message of every type, each with its arrays non-empty where it can."""
    return [
        messages.AddRequest("a", np.arange(1, 5, dtype=I32),
                            SamplingParams(seed=3, stop_token_ids=(1,), logit_bias=((4, -1.5),)), 1.0),
        messages.AbortRequest(["a", "b"], np.asarray([0, messages.ALL_CHOICES], I32)),
        step_plan(7, ["a", "b"], [0, 16], [[1], [2, 3]]),
        messages.StepResult(7, np.asarray([5, 6], I32), "", LogprobEntries(
            rows=np.zeros(1, I32), positions=np.ones(1, I32), token_ids=np.full(1, 5, I32),
            logprobs=np.zeros(1, F32), ranks=np.ones(1, I32), cu_top=np.asarray([0, 1], I32), top_token_ids=np.full(1, 5, I32),
            top_logprobs=np.zeros(1, F32))),
        messages.WorkerReady(1, 64, 42),
        messages.StepOutputs(3, ["a"], np.asarray([0, 2], I32), np.asarray([9, 8], I32),
                             [messages.FinishReason.LENGTH], [""], messages.SchedulerStats(1, 0, 0, 0.25, 0),
                             0.01, 1.0, events=messages.LifecycleEvents(
                                 ["a"], np.zeros(1, I32), np.ones(1, np.uint8), np.ones(1))),
        control.ProcessReady("scheduler", 1, "ok"),
        control.ProcessFailed("worker0", 2, "no model"),
    ]


VALID_FRAMES = [codec.encode(message) for message in valid_messages()]

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=24),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=10)


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    """A valid message with one field (or an element of a list field, e.g. sampling params)
    replaced, dropped or added, or one array resized."""
    message = values = msgpack.unpackb(draw(st.sampled_from(VALID_FRAMES)))
    index = draw(st.integers(1, len(values) - 1))
    while isinstance(values[index], list) and values[index] and draw(st.integers(0, 3)):
        values = values[index]  # mutate inside it
        index = draw(st.integers(0, len(values) - 1))
    how = draw(st.sampled_from(["replace", "drop", "append", "resize"]))
    if how == "replace":
        values[index] = draw(msgpack_values)
    elif how == "drop":
        del values[index]
    elif how == "append":
        values.append(draw(msgpack_values))
    else:
        arrays = [i for i, value in enumerate(values) if isinstance(value, bytes)] or [index]
        values[draw(st.sampled_from(arrays))] = draw(st.binary(max_size=40))
    return msgpack.packb(message, use_bin_type=True)


@st.composite
def sampling_params_frames(draw: st.DrawFn) -> bytes:
    """An AddRequest whose sampling params have some fields (or their elements) replaced."""
    values = msgpack.unpackb(VALID_FRAMES[0])
    params = values[3]
    for _ in range(draw(st.integers(1, 3))):
        parent, index = params, draw(st.integers(0, len(params) - 1))
        while isinstance(parent[index], list) and parent[index] and draw(st.booleans()):
            parent = parent[index]  # e.g. one [token id, bias] pair of logit_bias
            index = draw(st.integers(0, len(parent) - 1))
        parent[index] = draw(msgpack_values)
    return msgpack.packb(values, use_bin_type=True)


@st.composite
def truncated_frames(draw: st.DrawFn) -> bytes:
    frame = draw(st.sampled_from(VALID_FRAMES))
    return frame[:draw(st.integers(0, len(frame) - 1))]


# Headers of a str32 / bin32 / array32 / map32 claiming up to 4 GiB, alone or as a message field.
_HUGE_HEADERS = st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf"]).flatmap(
    lambda head: st.integers(2**20, 2**32 - 1).map(lambda n: head + n.to_bytes(4, "big")))
huge_prefix_frames = st.one_of(
    _HUGE_HEADERS, st.tuples(st.integers(0, len(VALID_FRAMES) - 1), _HUGE_HEADERS, st.binary(max_size=8))
    .map(lambda t: b"\x93" + bytes([t[0]]) + t[1] + t[2]))


def any_frames() -> st.SearchStrategy[bytes]:
    """Frames of every kind: garbage, and valid messages of any channel."""
    return st.one_of(st.binary(max_size=200), truncated_frames(), mutated_frames(), sampling_params_frames(),
                     huge_prefix_frames,
                     msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
                     st.sampled_from(VALID_FRAMES))


def rejected_frames(expected: tuple[type, ...]) -> st.SearchStrategy[bytes]:
    """Frames that are no valid message of a channel reading `expected` (decode rejects them)."""
    return any_frames().filter(lambda frame: _rejected(frame, expected))


def _rejected(frame: bytes, expected: tuple[type, ...]) -> bool:
    try:
        codec.decode(frame, expected)
    except ProtocolError:
        return True
    return False
