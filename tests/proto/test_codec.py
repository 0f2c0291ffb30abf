"""proto: every message round-trips; malformed frames are rejected with ProtocolError."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from proto import codec, control, messages
from proto.config import EngineConfig
from proto.errors import ProtocolError, ValidationError
from proto.sampling import SamplingParams
from proto.sampling_columns import LogitBias, PenaltyHistory, SamplingColumns

FR = messages.FinishReason


def _plan(num_seqs: int = 2) -> messages.StepPlan:
    i32 = lambda values: np.asarray(values, dtype=np.int32)  # noqa: E731
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=5,
                                                              repetition_penalty=1.1)][:num_seqs]
    sampling = dataclasses.replace(
        SamplingColumns.of_params(params, seeds=[1, 2**62][:num_seqs]),
        bias=LogitBias(i32([1]), i32([9]), np.asarray([-np.inf], dtype=np.float32)),
        history=PenaltyHistory(i32([0, 0, 3][: num_seqs + 1]), i32([1, 2, 3]), i32([0, 2][:num_seqs])))
    return messages.StepPlan(
        step_id=7, request_ids=[f"r{i}" for i in range(num_seqs)],
        input_ids=i32([5, 6, 7, 8][: num_seqs + 1]), num_computed_tokens=i32([0, 10][:num_seqs]),
        num_scheduled_tokens=i32([2, 1][:num_seqs]), cu_block_ids=i32([0, 1, 2][: num_seqs + 1]),
        block_ids=i32([3, 4][:num_seqs]), sample_mask=np.ones(num_seqs, dtype=bool), sampling=sampling)


def _stats(num_running: int = 0, num_waiting: int = 0, kv_cache_usage: float = 0.0) -> messages.SchedulerStats:
    return messages.SchedulerStats(num_running, num_waiting, 0, kv_cache_usage, 0)


def _assert_equal(a: object, b: object) -> None:
    assert type(a) is type(b)
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, np.ndarray):
            assert value.dtype == other.dtype and np.array_equal(value, other), name
        elif dataclasses.is_dataclass(value):
            _assert_equal(value, other)
        else:
            assert value == other, name


@pytest.mark.parametrize("message", [
    messages.AddRequest("a", np.arange(4, dtype=np.int32),
                        SamplingParams(temperature=0.5, seed=3, stop_token_ids=(1, 2),
                                       logit_bias=((4, -1.5),)), 12.5),
    messages.AbortRequest(["a", "b"]),
    messages.AbortRequest(["a", "b"], np.asarray([1, messages.ALL_CHOICES], dtype=np.int32)),
    _plan(),
    messages.StepResult(7, np.asarray([1, 2], dtype=np.int32), ""),
    messages.WorkerReady(0, 128, 42),
    messages.StepOutputs(3, ["a"], np.asarray([0, 2], dtype=np.int32), np.asarray([9, 8], dtype=np.int32),
                         [FR.LENGTH], [""], _stats(1, 0, 0.25), 0.01, 1.0),
    messages.StepOutputs(-1, ["a", "b"], np.zeros(3, dtype=np.int32), np.zeros(0, dtype=np.int32),
                         [FR.ERROR, FR.STOP], ["the waiting queue is full", ""], _stats(0, 2), 0.0, 1.0,
                         error_codes=np.asarray([messages.ERROR_QUEUE_FULL, 0], dtype=np.uint8)),
    control.ProcessReady("scheduler", 1, "ok"),
    control.ProcessFailed("worker0", 2, "no model"),
])
def test_every_message_round_trips(message: object) -> None:
    _assert_equal(codec.decode(codec.encode(message), type(message)), message)


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([]), msgpack.packb([99]),
    msgpack.packb([True]), msgpack.packb([1, [1]]), msgpack.packb([1, "notalist"]),
    msgpack.packb([3, 7, b"\x01\x02\x03", "x"]),  # StepResult with 3 bytes of int32
])
def test_malformed_frames_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        codec.decode(frame, messages.MESSAGE_TYPES)


def test_plan_with_inconsistent_lengths_is_rejected() -> None:
    frame = msgpack.unpackb(codec.encode(_plan()))
    frame[3] = np.asarray([1, 2, 3, 4, 5], dtype=np.int32).tobytes()  # input_ids != sum(scheduled)
    with pytest.raises(ProtocolError, match="num_scheduled_tokens"):
        codec.decode(msgpack.packb(frame), messages.MESSAGE_TYPES)


def test_outputs_with_unknown_finish_reason_are_rejected() -> None:
    message = messages.StepOutputs(1, ["a"], np.asarray([0, 0], dtype=np.int32), np.zeros(0, np.int32),
                                   ["exploded"], [""], _stats())
    with pytest.raises(ProtocolError, match="not a FinishReason"):
        codec.decode(codec.encode(message), type(message))


@pytest.mark.parametrize("choice_indices, match", [
    ([0], "needs 0 or 2 entries"),
    ([0, -2], "must be >= -1"),
])
def test_abort_with_bad_choice_indices_is_rejected(choice_indices: list[int], match: str) -> None:
    message = messages.AbortRequest(["a", "b"], np.asarray(choice_indices, dtype=np.int32))
    with pytest.raises(ProtocolError, match=match):
        codec.decode(codec.encode(message), type(message))


@pytest.mark.parametrize("finish_reason, code, match", [
    (FR.ERROR, len(messages.ERROR_CODES), "unknown error code"),
    (FR.STOP, messages.ERROR_QUEUE_FULL, "did not finish with"),
])
def test_outputs_with_a_bad_error_code_are_rejected(finish_reason: FR, code: int, match: str) -> None:
    message = messages.StepOutputs(-1, ["a"], np.zeros(2, dtype=np.int32), np.zeros(0, np.int32),
                                   [finish_reason], [""], _stats(),
                                   error_codes=np.asarray([code], dtype=np.uint8))
    with pytest.raises(ProtocolError, match=match):
        codec.decode(codec.encode(message), type(message))


def test_sampling_params_out_of_range_are_rejected_on_decode() -> None:
    frame = msgpack.unpackb(codec.encode(messages.AddRequest(
        "a", np.arange(3, dtype=np.int32), SamplingParams(), 0.0)))
    frame[3][1] = -1.0  # temperature
    with pytest.raises(ProtocolError, match="temperature"):
        codec.decode(msgpack.packb(frame), messages.MESSAGE_TYPES)


@pytest.mark.parametrize("value", [[1, "2"], [1, 2.0], [True], "12"])
def test_token_id_tuples_take_only_integers_on_decode(value: object) -> None:
    params = SamplingParams(allowed_token_ids=(1, 2), bad_words_token_ids=((1, 2),))
    frame = msgpack.unpackb(codec.encode(messages.AddRequest("a", np.arange(3, dtype=np.int32), params, 0.0)))
    index = [f.name for f in dataclasses.fields(SamplingParams)].index("allowed_token_ids")
    assert frame[3][index] == [1, 2]
    frame[3][index] = value
    with pytest.raises(ProtocolError, match="allowed_token_ids must be an array of integers"):
        codec.decode(msgpack.packb(frame), messages.MESSAGE_TYPES)


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ({"max_tokens": "8"}, "max_tokens"),
])
def test_sampling_params_name_the_offending_field(kwargs: dict, param: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_token_ids_are_checked_against_the_vocabulary() -> None:
    with pytest.raises(ValidationError, match="out of range for a vocabulary of 100"):
        SamplingParams(logit_bias=((100, 1.0),)).check_vocab(100)


def test_engine_config_round_trips_through_json_and_rejects_bad_values() -> None:
    config = EngineConfig(model="/m", eos_token_ids=(1, 2), scheduling="static")
    assert EngineConfig.from_json(config.to_json()) == config
    with pytest.raises(ValidationError, match="scheduling"):
        EngineConfig(scheduling="fifo")
    with pytest.raises(ValidationError, match="max_num_seqs must be >= 1, got 0"):
        EngineConfig(max_num_seqs=0)
    for name in ("ready_timeout_s", "step_timeout_s", "stall_timeout_s", "restart_window_s"):
        with pytest.raises(ValidationError, match=f"{name} must be > 0 seconds, got 0"):
            EngineConfig(**{name: 0})
    with pytest.raises(ValidationError, match="shutdown_timeout_s must be >= 0, got -1"):
        EngineConfig(shutdown_timeout_s=-1)
