"""MessagePack codec for proto messages: a tag plus field values; arrays as raw little-endian bytes.

`decode` validates the tag, every field's type, array byte lengths and cross-field shapes, and
raises ProtocolError for anything else. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import numpy as np

from proto import messages
from proto.errors import ProtocolError, ValidationError
from proto.sampling import SamplingParams

_TAG_OF = {cls: tag for tag, cls in enumerate(messages.MESSAGE_TYPES)}
_CLASS_OF = dict(enumerate(messages.MESSAGE_TYPES))
_FIELDS = {cls: dataclasses.fields(cls) for cls in messages.MESSAGE_TYPES}
_HINTS = {cls: typing.get_type_hints(cls) for cls in messages.MESSAGE_TYPES}
_SCALAR_KINDS = {int: (int,), float: (float, int), str: (str,), bool: (bool,)}


def encode(message: object) -> bytes:
    cls = type(message)
    if cls not in _TAG_OF:
        raise TypeError(f"not a proto message: {cls.__name__}")
    values: list = [_TAG_OF[cls]]
    for f in _FIELDS[cls]:
        value = getattr(message, f.name)
        if isinstance(value, np.ndarray):
            dtype = np.dtype(cls.ARRAY_DTYPES[f.name]).newbyteorder("<")
            value = np.ascontiguousarray(value, dtype=dtype).tobytes()
        elif isinstance(value, SamplingParams):
            value = value.to_wire()
        values.append(value)
    return msgpack.packb(values, use_bin_type=True)


def decode(frame: bytes, expected: tuple[type, ...] = messages.MESSAGE_TYPES) -> object:
    """The message in `frame`, which must be one of `expected` (the reading channel's types).
    Anything else raises ProtocolError, and only that. msgpack bounds every length prefix by the
    frame's size, so a forged one allocates nothing."""
    try:
        values = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"frame is not valid MessagePack ({len(frame)} bytes): {exc}") from exc
    if not isinstance(values, list) or not values:
        raise ProtocolError("frame must be a non-empty array [tag, fields...]")
    tag = values[0]
    if not isinstance(tag, int) or isinstance(tag, bool) or tag not in _CLASS_OF:
        raise ProtocolError(f"unknown message tag {tag!r:.40}")
    cls = _CLASS_OF[tag]
    if cls not in expected:
        raise ProtocolError(f"{cls.__name__} does not belong on this channel "
                            f"(expected {' or '.join(c.__name__ for c in expected)})")
    fields = _FIELDS[cls]
    if len(values) - 1 != len(fields):
        raise ProtocolError(f"{cls.__name__} needs {len(fields)} fields, got {len(values) - 1}")
    kwargs = {f.name: _decode_field(cls, f.name, v) for f, v in zip(fields, values[1:])}
    message = cls(**kwargs)
    _check_shapes(message)
    return message


def _decode_field(cls: type, name: str, value: object) -> object:
    hint = _HINTS[cls][name]
    where = f"{cls.__name__}.{name}"
    if hint is np.ndarray:
        if not isinstance(value, bytes):
            raise ProtocolError(f"{where} must be bytes, got {type(value).__name__}")
        dtype = np.dtype(cls.ARRAY_DTYPES[name]).newbyteorder("<")
        if len(value) % dtype.itemsize:
            raise ProtocolError(f"{where} has {len(value)} bytes, not a multiple of {dtype.itemsize}")
        return np.frombuffer(value, dtype=dtype).astype(dtype.newbyteorder("="), copy=False)
    if hint is SamplingParams:
        try:
            return SamplingParams.from_wire(value)
        except (ValidationError, TypeError) as exc:
            raise ProtocolError(f"{where}: {exc}") from exc
    if hint == list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ProtocolError(f"{where} must be a list of strings")
        return value
    kinds = _SCALAR_KINDS[hint]
    if not isinstance(value, kinds) or (hint is not bool and isinstance(value, bool)):
        raise ProtocolError(f"{where} must be {hint.__name__}, got {type(value).__name__}")
    return float(value) if hint is float else value


def _check_shapes(message: object) -> None:
    if isinstance(message, messages.StepPlan):
        _check_plan(message)
    elif isinstance(message, messages.StepOutputs):
        _check_outputs(message)
    elif isinstance(message, messages.StepResult):
        _need(message.rank >= 0, f"StepResult.rank must be >= 0, got {message.rank}")
        _check_logprobs("StepResult", message, None)
    elif isinstance(message, messages.AddRequest):
        _need(len(message.prompt_token_ids) > 0, "AddRequest.prompt_token_ids is empty")
        _need(bool((message.prompt_token_ids >= 0).all()), "AddRequest has negative token ids")
    elif isinstance(message, messages.AbortRequest):
        _check_abort(message)


def _check_abort(message: messages.AbortRequest) -> None:
    n, choices = len(message.request_ids), message.choice_indices
    _need(len(choices) in (0, n), f"AbortRequest.choice_indices needs 0 or {n} entries, got {len(choices)}")
    lowest = int(choices.min()) if len(choices) else 0
    _need(lowest >= messages.ALL_CHOICES,
          f"AbortRequest.choice_indices must be >= {messages.ALL_CHOICES} (all choices), got {lowest}")


def _check_outputs(message: messages.StepOutputs) -> None:
    n = message.num_outputs
    _need(len(message.finish_reasons) == n and len(message.error_messages) == n,
          "StepOutputs lists must all have one entry per request")
    _check_offsets("StepOutputs.cu_new_tokens", message.cu_new_tokens, n, len(message.new_token_ids))
    bad = set(message.finish_reasons) - set(messages.FINISH_REASONS)
    _need(not bad, f"StepOutputs has unknown finish reasons {sorted(bad)}")
    for name in ("choice_indices", "num_cached_tokens", "error_codes"):
        _need(len(getattr(message, name)) in (0, n), f"StepOutputs.{name} needs 0 or {n} entries")
    _check_error_codes(message)
    num_events = len(message.event_request_ids)
    _need(len(message.event_choice_indices) == num_events and len(message.event_kinds) == num_events
          and len(message.event_times_s) == num_events, "StepOutputs event arrays differ in length")
    _need(num_events == 0 or int(message.event_kinds.max()) < len(messages.EVENT_KINDS),
          "StepOutputs has an unknown event kind")
    _check_logprobs("StepOutputs", message, n)


def _check_error_codes(message: messages.StepOutputs) -> None:
    codes = message.error_codes
    if not len(codes):
        return
    _need(int(codes.max()) < len(messages.ERROR_CODES),
          f"StepOutputs has an unknown error code {int(codes.max())}")
    coded = np.flatnonzero(codes).tolist()
    _need(all(message.finish_reasons[row] == "error" for row in coded),
          "StepOutputs has an error code on a row that did not finish with \"error\"")


def _check_logprobs(where: str, message: object, num_rows: int | None) -> None:
    num_entries = len(message.lp_rows)
    for name in ("lp_positions", "lp_token_ids", "lp_logprobs"):
        _need(len(getattr(message, name)) == num_entries, f"{where}.{name} needs {num_entries} entries")
    _check_offsets(f"{where}.lp_cu_top", message.lp_cu_top, num_entries, len(message.lp_top_token_ids))
    _need(len(message.lp_top_logprobs) == len(message.lp_top_token_ids),
          f"{where} top logprob arrays differ in length")
    if num_rows is not None and num_entries:
        _need(0 <= int(message.lp_rows.min()) and int(message.lp_rows.max()) < num_rows,
              f"{where}.lp_rows out of range")


def _check_plan(plan: messages.StepPlan) -> None:
    n = plan.num_seqs
    for name in ("num_computed_tokens", "num_scheduled_tokens", "sample_mask", "temperature",
                 "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seeds", "history_num_prompt"):
        _need(len(getattr(plan, name)) == n, f"StepPlan.{name} needs {n} entries")
    for name in ("num_logprobs", "num_prompt_logprobs", "next_prompt_token_ids"):
        _need(len(getattr(plan, name)) in (0, n), f"StepPlan.{name} needs 0 or {n} entries")
    _need(bool((plan.num_scheduled_tokens >= 1).all()), "StepPlan schedules a member with no tokens")
    _need(bool((plan.num_computed_tokens >= 0).all()), "StepPlan has negative num_computed_tokens")
    _need(int(plan.num_scheduled_tokens.sum()) == len(plan.input_ids),
          "StepPlan.input_ids length differs from the sum of num_scheduled_tokens")
    _check_offsets("StepPlan.cu_block_ids", plan.cu_block_ids, n, len(plan.block_ids))
    _check_offsets("StepPlan.cu_history", plan.cu_history, n, len(plan.history_token_ids))
    nb = len(plan.bias_rows)
    _need(len(plan.bias_token_ids) == nb and len(plan.bias_values) == nb,
          "StepPlan bias arrays differ in length")
    _need(nb == 0 or (0 <= int(plan.bias_rows.min()) and int(plan.bias_rows.max()) < n),
          "StepPlan.bias_rows out of range")


def _check_offsets(where: str, offsets: np.ndarray, n: int, total: int) -> None:
    _need(len(offsets) == n + 1, f"{where} needs {n + 1} entries, got {len(offsets)}")
    _need(int(offsets[0]) == 0 and int(offsets[-1]) == total, f"{where} must run from 0 to {total}")
    _need(bool((np.diff(offsets) >= 0).all()), f"{where} must be non-decreasing")


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise ProtocolError(message)
