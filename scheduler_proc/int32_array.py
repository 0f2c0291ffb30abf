"""A growable int32 array with zero-copy views: token ids and block tables of a sequence."""

from __future__ import annotations

import numpy as np


class Int32Array:
    """Amortised O(1) appends and zero-copy views of the filled prefix.

    A view taken before a growth keeps showing the old contents; take a fresh one after appending.
    """

    def __init__(self, initial: np.ndarray | None = None, capacity: int = 16) -> None:
        size = 0 if initial is None else len(initial)
        self._data = np.empty(max(capacity, size, 1), dtype=np.int32)  # int32 [capacity]
        self._capacity = len(self._data)
        self._size = 0
        if initial is not None:
            self.extend(initial)

    def __len__(self) -> int:
        return self._size

    @property
    def view(self) -> np.ndarray:
        return self._data[:self._size]  # int32 [len]

    def append(self, value: int) -> None:
        if self._size == self._capacity:
            self._reserve(self._size + 1)
        self._data[self._size] = value
        self._size += 1

    def extend(self, values: np.ndarray | list[int]) -> None:
        end = self._size + len(values)
        self._reserve(end)
        self._data[self._size:end] = values
        self._size = end

    def clear(self) -> None:
        self._size = 0

    def _reserve(self, capacity: int) -> None:
        if capacity > len(self._data):
            grown = np.empty(max(capacity, 2 * len(self._data)), dtype=np.int32)
            grown[:self._size] = self._data[:self._size]
            self._data = grown
            self._capacity = len(grown)
