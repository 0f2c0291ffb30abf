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



# Starting a process by module name (`python -m NAME`) couples two packages without an import.
# Every such name that one package writes for another's module is declared here, with why.
ALLOWED_MODULE_COUPLINGS = {
    ("deploy", "frontend"): "the supervisor starts the frontend process",
    ("deploy", "scheduler_proc"): "the supervisor starts the scheduler process",
    ("deploy", "worker_proc"): "the supervisor starts one worker process per rank",
    ("deploy", "worker_proc.tools.convert_gguf"): "the default model's GGUF is converted with torch, "
                                                  "in a worker-side process",
    ("deploy", "scheduler_proc.tools.simulate"): "`conveyor simulate` runs the slot simulator on its trace",
    ("scheduler_proc", "worker_proc"): "bench_overhead times the scheduler against a null-model worker",
    ("worker_proc", "scheduler_proc.tools.bench_overhead"): "profile_step adds the scheduler's per-step "
                                                            "overhead to its report",
}


def _our_modules() -> set[str]:
    """Every module and package of ours by dotted name (`python -m` accepts both)."""
    names = set()
    for package in OUR_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] in ("__init__", "__main__") else parts))
    return names


def _module_name_couplings() -> set[tuple[str, str]]:
    """(package, module) for every string constant in `package` naming another package's module."""
    modules = _our_modules()
    found = set()
    for package in OUR_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules
                        and node.value.split(".")[0] != package):
                    found.add((package, node.value))
    return found


def test_processes_started_by_module_name_are_the_declared_couplings() -> None:
    assert _module_name_couplings() == set(ALLOWED_MODULE_COUPLINGS)


@pytest.mark.parametrize("module", sorted({module for _, module in ALLOWED_MODULE_COUPLINGS}))
def test_every_module_started_by_name_can_be_run(module: str) -> None:
    path = ROOT.joinpath(*module.split("."))
    main = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
    assert main.is_file(), f"{module} is started by name but {main} does not exist"
    assert main.name == "__main__.py" or '__name__ == "__main__"' in main.read_text()


def test_every_package_of_ours_is_in_the_wheel() -> None:
    """pyproject.toml lists packages by hand: one left out is missing from `pip install .`."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for package in OUR_PACKAGES
             for init in (ROOT / package).rglob("__init__.py")}
    assert found == listed
