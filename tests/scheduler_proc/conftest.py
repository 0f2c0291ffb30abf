"""Lets the scheduler tests import their fakes (scheduler_fakes) under --import-mode=importlib."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)  # appended: never shadows tests/conftest.py or the real scheduler_proc
