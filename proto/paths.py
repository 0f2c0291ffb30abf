"""Where conveyor keeps files between runs: $CONVEYOR_CACHE, by default ~/.cache/conveyor."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Models (deploy) and built native kernels (worker_proc) live under this directory."""
    return Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
