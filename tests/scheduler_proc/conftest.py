"""Make this folder's fakes importable (`from scheduler_fakes import ...`) under --import-mode=importlib."""

from __future__ import annotations

import sys
from pathlib import Path

# `scheduler_proc.*` names the real package, so the fakes live in a uniquely named top-level module.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
