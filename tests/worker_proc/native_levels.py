"""Test helper: the ISA levels this CPU can build the native library's vector paths at, and the
library built at one of them (or the test skipped, with the reason)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from deploy.cpu_isa import cpu_isa, rank, read_cpu_flags
from worker_proc.attention.native_kernel import vectorised_library

MACHINE = cpu_isa(read_cpu_flags())
# "" = -march=native; then each capped level at or below this CPU's that has AVX2 + FMA.
VECTOR_LEVELS = ["", *(level for level in ("avx2", "avx512") if rank(level) <= rank(MACHINE.detected))]
LEVEL_IDS = [level or "native" for level in VECTOR_LEVELS]


def vectorised_or_skip(level: str, probe: str, dtype: torch.dtype = torch.float32) -> tuple[ctypes.CDLL, int | None]:
    found = vectorised_library(dtype, (dtype,), level, probe)
    if isinstance(found, str):
        pytest.skip(found)
    return found
