"""MessagePack codec for proto messages: a tag plus field values; arrays as raw little-endian bytes.

Every field is handled by its type annotation, nested frozen dataclasses included (as a list of
their fields): array aliases (proto.arrays) by their dtype, enums by value, lists, tuples,
optionals and scalars. `decode` validates the tag, every field's type, array byte lengths and
cross-field shapes (proto.checks), and raises ProtocolError for anything else. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from typing import TypeVar, overload

import msgpack
import numpy as np

from proto import checks, messages
from proto.arrays import array_dtype
from proto.errors import ProtocolError, ValidationError

Message = TypeVar("Message")
_Decoder = Callable[[object, str], object]

_TAG_OF = {cls: tag for tag, cls in enumerate(messages.MESSAGE_TYPES)}
_CLASS_OF = dict(enumerate(messages.MESSAGE_TYPES))
_SCALARS = {int: (int,), float: (float, int), str: (str,), bool: (bool,)}
_ENCODERS: dict[type, list[tuple[str, Callable[[object], object] | None]]] = {}
_DECODERS: dict[type, list[tuple[str, _Decoder]]] = {}


def encode(message: object) -> bytes:
    cls = type(message)
    if cls not in _TAG_OF:
        raise TypeError(f"not a proto message: {cls.__name__}")
    return msgpack.packb([_TAG_OF[cls], *_encode_fields(message)], use_bin_type=True)


@overload
def decode(frame: bytes, expected: type[Message]) -> Message: ...


@overload
def decode(frame: bytes, expected: tuple[type, ...]) -> object: ...


def decode(frame: bytes, expected: type | tuple[type, ...]) -> object:
    """The message in `frame`, which must be `expected` (or one of them: the reading channel's
    types). Anything else raises ProtocolError, and only that. msgpack bounds every length prefix
    by the frame's size, so a forged one allocates nothing."""
    expected = expected if isinstance(expected, tuple) else (expected,)
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
    return _build(cls, values[1:], cls.__name__)


def _encode_fields(value: object) -> list:
    cls = type(value)
    encoders = _ENCODERS.get(cls) or _compile_encoders(cls)
    return [getattr(value, name) if encoder is None else encoder(getattr(value, name))
            for name, encoder in encoders]


def _compile_encoders(cls: type) -> list[tuple[str, Callable[[object], object] | None]]:
    """Per field: None (msgpack packs it as is: scalars, str/int enums, lists, tuples) or a
    converter (arrays to bytes, nested dataclasses to field lists)."""
    encoders: list[tuple[str, Callable[[object], object] | None]] = []
    for name, hint in _hints(cls).items():
        dtype = array_dtype(hint)
        if dtype is not None:
            wire = dtype.newbyteorder("<")
            encoders.append((name, lambda v, wire=wire: np.ascontiguousarray(v, dtype=wire).tobytes()))
        elif dataclasses.is_dataclass(hint):
            encoders.append((name, _encode_fields))
        elif _optional_dataclass(hint):
            encoders.append((name, lambda v: None if v is None else _encode_fields(v)))
        else:
            encoders.append((name, None))
    _ENCODERS[cls] = encoders
    return encoders


def _optional_dataclass(hint: object) -> bool:
    """`SomeDataclass | None`: nested fields, or nil."""
    args = typing.get_args(hint)
    return (typing.get_origin(hint) is types.UnionType and type(None) in args
            and any(dataclasses.is_dataclass(arg) for arg in args))


def _build(cls: type, values: object, where: str) -> object:
    """A dataclass from its field list: every field decoded, then constructed and checked."""
    decoders = _DECODERS.get(cls) or _compile_decoders(cls)
    if not isinstance(values, list) or len(values) != len(decoders):
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise ProtocolError(f"{where} needs {len(decoders)} fields, got {got}")
    kwargs = {name: decoder(value, f"{where}.{name}") for (name, decoder), value in zip(decoders, values)}
    try:
        built = cls(**kwargs)
    except (ValidationError, TypeError, ValueError, RecursionError) as exc:  # a nested type's own validation
        raise ProtocolError(f"{where}: {exc}") from exc
    checks.check(built)
    return built


def _compile_decoders(cls: type) -> list[tuple[str, _Decoder]]:
    decoders = [(name, _decoder_of(hint)) for name, hint in _hints(cls).items()]
    _DECODERS[cls] = decoders
    return decoders


def _hints(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _decoder_of(hint: object) -> _Decoder:
    dtype = array_dtype(hint)
    if dtype is not None:
        return _array_decoder(dtype)
    if dataclasses.is_dataclass(hint):
        return lambda value, where: _build(hint, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_decoder(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list and args[0] is str:
        return _decode_str_list
    if origin is list:
        return _sequence_decoder(_decoder_of(args[0]), list)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] is int:
        return _decode_int_tuple
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _sequence_decoder(_decoder_of(args[0]), tuple)
    if origin is tuple:
        return _fixed_tuple_decoder([_decoder_of(arg) for arg in args])
    if origin is types.UnionType and type(None) in args:
        (inner,) = [arg for arg in args if arg is not type(None)]
        decode_inner = _decoder_of(inner)
        return lambda value, where: None if value is None else decode_inner(value, where)
    if hint in _SCALARS:
        return _scalar_decoder(hint)
    raise TypeError(f"the codec cannot carry fields of type {hint!r}")


def _array_decoder(dtype: np.dtype) -> _Decoder:
    wire, native = dtype.newbyteorder("<"), dtype.newbyteorder("=")

    def decode_array(value: object, where: str) -> np.ndarray:
        if not isinstance(value, bytes):
            raise ProtocolError(f"{where} must be bytes, got {type(value).__name__}")
        if len(value) % wire.itemsize:
            raise ProtocolError(f"{where} has {len(value)} bytes, not a multiple of {wire.itemsize}")
        return np.frombuffer(value, dtype=wire).astype(native, copy=False)
    return decode_array


def _enum_decoder(kind: type[enum.Enum]) -> _Decoder:
    by_value = {member.value: member for member in kind}
    value_type = str if issubclass(kind, str) else int

    def decode_enum(value: object, where: str) -> enum.Enum:
        if type(value) is not value_type or value not in by_value:
            raise ProtocolError(f"{where}: {value!r:.40} is not a {kind.__name__}")
        return by_value[value]
    return decode_enum


def _decode_str_list(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(type(item) is str for item in value):
        raise ProtocolError(f"{where} must be a list of strings")
    return value


def _decode_int_tuple(value: object, where: str) -> tuple[int, ...]:
    """A tuple of ints at C speed (allowed_token_ids may list a whole vocabulary)."""
    if not isinstance(value, list) or not all(type(item) is int for item in value):
        raise ProtocolError(f"{where} must be an array of integers")
    return tuple(value)


def _sequence_decoder(decode_item: _Decoder, kind: type) -> _Decoder:
    def decode_sequence(value: object, where: str) -> object:
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be an array, got {type(value).__name__}")
        return kind([decode_item(item, where) for item in value])
    return decode_sequence


def _fixed_tuple_decoder(decode_items: list[_Decoder]) -> _Decoder:
    def decode_tuple(value: object, where: str) -> tuple:
        if not isinstance(value, list) or len(value) != len(decode_items):
            raise ProtocolError(f"{where} must be an array of {len(decode_items)}, got {value!r:.40}")
        return tuple(decode(item, where) for decode, item in zip(decode_items, value))
    return decode_tuple


def _scalar_decoder(kind: type) -> _Decoder:
    accepted = _SCALARS[kind]

    def decode_scalar(value: object, where: str) -> object:
        if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
            raise ProtocolError(f"{where} must be {kind.__name__}, got {type(value).__name__}")
        return float(value) if kind is float else value
    return decode_scalar
