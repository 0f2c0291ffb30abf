"""The package dependency rule of DESIGN.md §1, checked on the source tree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROCESS_PACKAGES = ("frontend", "scheduler_proc", "worker_proc", "deploy")
OUR_PACKAGES = ("proto", *PROCESS_PACKAGES)


def _imported_roots(package: str) -> set[str]:
    roots: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                roots.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                roots.add(node.module.split(".")[0])
    return roots


def test_proto_imports_nothing_of_ours() -> None:
    assert _imported_roots("proto") & set(OUR_PACKAGES) <= {"proto"}


@pytest.mark.parametrize("package", PROCESS_PACKAGES)
def test_no_process_package_imports_another(package: str) -> None:
    others = set(PROCESS_PACKAGES) - {package}
    assert not _imported_roots(package) & others


@pytest.mark.parametrize("package", ["proto", "frontend", "scheduler_proc", "deploy"])
def test_only_the_worker_imports_torch(package: str) -> None:
    assert not _imported_roots(package) & {"torch", "transformers"}


@pytest.mark.parametrize("module", ["scheduler_proc.__main__", "frontend.__main__", "deploy.cli"])
def test_process_entry_points_load_without_torch(module: str) -> None:
    code = (f"import importlib, sys, time; t = time.monotonic(); importlib.import_module({module!r}); "
            "print(time.monotonic() - t); assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

