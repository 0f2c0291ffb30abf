"""Which allocator the CPU workers get: glibc's unless CONVEYOR_MALLOC asks for tcmalloc; bad
values and a missing required tcmalloc are refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy import allocator
from deploy.allocator import allocator_env, find_tcmalloc
from deploy.devices import worker_env
from proto.config import EngineConfig
from proto.errors import ValidationError

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


@pytest.mark.parametrize(("environ", "found", "expected"), [
    ({}, TCMALLOC, {}),
    ({"CONVEYOR_MALLOC": "auto"}, TCMALLOC, {"LD_PRELOAD": TCMALLOC}),
    ({"CONVEYOR_MALLOC": "auto"}, None, {}),
    ({"CONVEYOR_MALLOC": "tcmalloc"}, TCMALLOC, {"LD_PRELOAD": TCMALLOC}),
    ({"CONVEYOR_MALLOC": "system"}, TCMALLOC, {}),
    ({"CONVEYOR_MALLOC": "auto", "LD_PRELOAD": "/opt/my.so"}, TCMALLOC, {}),  # the caller's own stays
])
def test_the_decision_table(environ: dict[str, str], found: str | None, expected: dict[str, str]) -> None:
    assert allocator_env(environ, lambda: found) == expected


def test_a_required_tcmalloc_that_is_missing_and_a_bad_value_are_refused() -> None:
    with pytest.raises(ValidationError, match="no libtcmalloc is installed.*libtcmalloc-minimal4"):
        allocator_env({"CONVEYOR_MALLOC": "tcmalloc"}, lambda: None)
    with pytest.raises(ValidationError, match=r"CONVEYOR_MALLOC must be one of .*got 'jemalloc'"):
        allocator_env({"CONVEYOR_MALLOC": "jemalloc"}, lambda: TCMALLOC)


def test_find_tcmalloc_returns_the_path_of_the_soname_ldconfig_knows(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    names = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}
    monkeypatch.setattr(allocator.ctypes.util, "find_library", names.get)
    assert find_tcmalloc((str(tmp_path),)) is None  # known to ldconfig, but not in these directories
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc((str(tmp_path / "lib"),)) == str(tmp_path / "lib" / "libtcmalloc_minimal.so.4")


def test_cpu_workers_get_it_when_asked_and_gpu_workers_never(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("CONVEYOR_MALLOC", raising=False)
    assert "LD_PRELOAD" not in worker_env(EngineConfig(), 0, [])
    monkeypatch.setenv("CONVEYOR_MALLOC", "auto")
    cpu = worker_env(EngineConfig(), 0, [])
    assert cpu.get("LD_PRELOAD") == find_tcmalloc()  # None where this machine has no tcmalloc
    assert "LD_PRELOAD" not in worker_env(EngineConfig(), 0, ["0"])


def test_the_default_does_not_look_for_tcmalloc() -> None:
    def find() -> str | None:
        raise AssertionError("the default start-up looked for tcmalloc")

    assert allocator_env({}, find) == {} and allocator_env({"CONVEYOR_MALLOC": "system"}, find) == {}
