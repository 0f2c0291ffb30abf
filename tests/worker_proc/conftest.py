"""Lets the worker tests import their plan-building helper (worker_plans) under importlib mode."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)  # appended: never shadows the real worker_proc package
