"""GPU tests: every module here skips cleanly without CUDA; they reuse the worker plan helpers."""

from __future__ import annotations

import sys
from pathlib import Path

_WORKER_TESTS = str(Path(__file__).resolve().parent.parent / "worker_proc")
if _WORKER_TESTS not in sys.path:
    sys.path.append(_WORKER_TESTS)  # worker_plans and the varlen contract kernel
