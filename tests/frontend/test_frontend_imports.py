"""The frontend loads neither torch nor transformers, nor another process package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "transformers", "scheduler_proc", "worker_proc", "deploy")


def test_importing_the_whole_frontend_loads_no_forbidden_package():
    modules = ["frontend.__main__", "frontend.app", "frontend.server"]
    code = (f"import sys, {', '.join(modules)}\n"
            f"print(','.join(m for m in {FORBIDDEN!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, check=True)
    assert result.stdout.strip() == ""
