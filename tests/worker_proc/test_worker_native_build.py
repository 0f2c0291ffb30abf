"""The native kernel's build: compiled once per sources, compiler, CPU and ISA cap, cached, and
failing with the compiler's own words (worker_proc/attention/native_build.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from worker_proc.attention import native_build
from worker_proc.attention import native_kernel as native


def sources(tmp_path: Path, text: str) -> Path:
    source_dir = tmp_path / "csrc"
    source_dir.mkdir(exist_ok=True)
    (source_dir / "answer.c").write_text(text)
    return source_dir


def test_a_built_kernel_is_reused_and_rebuilt_for_another_cpu_or_cap(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source_dir = sources(tmp_path, "int answer(void) { return 42; }\n")
    cache = tmp_path / "cache"
    try:
        first = native_build.build(cache, source_dir=source_dir)
    except native.NativeBuildError as error:
        pytest.skip(f"no working C compiler: {error}")
    built_at = first.stat().st_mtime_ns
    assert native_build.build(cache, source_dir=source_dir) == first
    assert first.stat().st_mtime_ns == built_at
    capped = native_build.build(cache, "baseline", source_dir=source_dir)
    monkeypatch.setattr(native_build, "_cpu_flags", lambda: "flags : another cpu")
    other = native_build.build(cache, source_dir=source_dir)
    assert len({first, capped, other}) == 3 and ctypes.CDLL(str(other)).answer() == 42
    assert sorted(cache.iterdir()) == sorted([first, capped, other])  # no partial files left behind


def test_the_build_compiles_the_source_it_hashed_even_if_the_file_changes_meanwhile(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source_dir = sources(tmp_path, "int answer(void) { return 42; }\n")
    try:
        cc = native_build.compiler()
    except native.NativeBuildError as error:
        pytest.skip(f"no C compiler: {error}")
    checkout = tmp_path / "checkout-cc"  # a compiler during which a checkout rewrites the source
    checkout.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] ||\n"
                        f"  echo 'int answer(void) {{ return 7; }}' > {source_dir / 'answer.c'}\n"
                        f"exec {cc} \"$@\"\n")
    checkout.chmod(0o755)
    monkeypatch.setenv("CC", str(checkout))
    built = native_build.build(tmp_path / "cache", source_dir=source_dir)
    assert ctypes.CDLL(str(built)).answer() == 42  # cached under the key of the 42 source


def test_a_build_that_hangs_fails_after_the_timeout_naming_the_command(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hanging = tmp_path / "hanging-cc"
    hanging.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo hanging-cc 1.0; exit 0; }\nexec sleep 60\n')
    hanging.chmod(0o755)
    monkeypatch.setenv("CC", str(hanging))
    monkeypatch.setattr(native_build, "BUILD_TIMEOUT_S", 0.5)
    with pytest.raises(native.NativeBuildError, match=r"took over 0.5 s: .*hanging-cc .*-fopenmp"):
        native_build.build(tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("name, is_runtime", [
    ("libgomp.so.1", True), ("libgomp-a34b3233.so.1", True), ("libiomp5.so", True), ("libomp.so.5", True),
    ("libomptarget.so", False), ("libgompd.so.1", False), ("libomptarget.rtl.x86_64.so", False),
])
def test_openmp_runtimes_are_told_from_their_sibling_libraries(name: str, is_runtime: bool) -> None:
    assert bool(native._OPENMP_RUNTIME.fullmatch(name)) == is_runtime


def test_a_failed_build_reports_the_compiler_error(tmp_path: Path) -> None:
    source_dir = sources(tmp_path, "int broken(void) { return undeclared_name; }\n")
    try:
        native_build.compiler()
    except native.NativeBuildError as error:
        pytest.skip(f"no C compiler: {error}")
    with pytest.raises(native.NativeBuildError, match="undeclared_name"):
        native_build.build(tmp_path / "cache", source_dir=source_dir)
    assert not list((tmp_path / "cache").iterdir())
