"""Array field types: each alias is a numpy array annotated with the one dtype the codec uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, get_args, get_origin

import numpy as np

BoolArray = Annotated[np.ndarray, np.bool_]
UInt8Array = Annotated[np.ndarray, np.uint8]
Int32Array = Annotated[np.ndarray, np.int32]
Int64Array = Annotated[np.ndarray, np.int64]
Float32Array = Annotated[np.ndarray, np.float32]
Float64Array = Annotated[np.ndarray, np.float64]


def array_dtype(hint: object) -> np.dtype | None:
    """The dtype an array alias declares; None for any other type hint."""
    if get_origin(hint) is Annotated:
        base, *extras = get_args(hint)
        if base is np.ndarray and len(extras) == 1:
            return np.dtype(extras[0])
    return None


def empty(dtype: type, size: int = 0) -> Callable[[], np.ndarray]:
    """A default_factory for an array field: `size` zeros (0 for an empty array, 1 for offsets)."""
    return lambda: np.zeros(size, dtype=dtype)
