"""Compiles the native CPU library (worker_proc/csrc: paged attention, the skinny linear, the fused
elementwise passes) once per machine and ISA cap, and caches it.

The shared library is cached in $CONVEYOR_CACHE/native under a key of the sources, the compiler's
version, the flags and this CPU's feature flags (-march=native code must never run on another CPU).
Uncapped it is compiled for this CPU (-march=native); under a cap (EngineConfig.cpu_isa) for that
level's baseline, so that the AVX2 paths can be built and run on an AVX-512 machine. The sources are
snapshotted into a private directory and compiled from there, so the bytes compiled are the bytes
hashed into the key even if a checkout rewrites them meanwhile; tensor-parallel workers may build at
once: each renames a complete file into place.

The kernel threads with OpenMP. Linked by soname (libgomp.so.1), it shares the OpenMP runtime that
torch's CPU wheels already loaded, so its threads are torch's own pool; a second runtime in the
process would leave two sets of spinning threads on the same cores (native_kernel.py then runs one
thread).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from proto.paths import cache_root

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent.parent / "csrc"  # worker_proc/csrc
FLAGS = ("-O3", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
LIBS = ("-lm",)
# EngineConfig.cpu_isa -> the code generation flags; x86-64-v3 is AVX2 + FMA + F16C, v4 AVX-512.
ARCH_FLAGS = {"": ("-march=native",), "baseline": ("-march=x86-64",), "avx2": ("-march=x86-64-v3",),
              "avx512": ("-march=x86-64-v4",), "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16"),
              "amx": ("-march=x86-64-v4", "-mavx512bf16")}
BUILD_TIMEOUT_S = 300


class NativeBuildError(RuntimeError):
    """The kernel could not be compiled or loaded on this machine; the message says why."""


def compiler() -> str:
    """$CC when set, else cc or gcc from PATH."""
    chosen = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not chosen:
        raise NativeBuildError("no C compiler: set CC or install cc/gcc")
    return chosen


def read_sources(source_dir: Path) -> dict[str, bytes]:
    """Every .c and .h file of source_dir by name, in name order."""
    return {path.name: path.read_bytes() for path in sorted(source_dir.iterdir())
            if path.suffix in (".c", ".h")}


def build(cache_dir: Path | None = None, cpu_isa: str = "", source_dir: Path | None = None) -> Path:
    """The shared library for these sources, compiler, ISA cap and CPU: reused from cache_dir
    (default $CONVEYOR_CACHE/native) or compiled into it. Raises NativeBuildError with the
    compiler's stderr."""
    if cpu_isa not in ARCH_FLAGS:
        raise NativeBuildError(f"no compile flags for CPU ISA {cpu_isa!r}; one of {sorted(ARCH_FLAGS)}")
    cc = compiler()
    cache_dir = cache_root() / "native" if cache_dir is None else cache_dir
    sources = read_sources(SOURCE_DIR if source_dir is None else source_dir)
    flags = (*FLAGS, *ARCH_FLAGS[cpu_isa])
    parts = [part for name, text in sources.items() for part in (name.encode(), text)]
    key = hashlib.sha256(b"\0".join([*parts, _compiler_version(cc).encode(), " ".join(flags + LIBS).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:24]
    target = cache_dir / f"paged_attention-{cpu_isa or 'native'}-{key}.so"
    if target.exists():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", suffix=".partial", dir=cache_dir))
    except OSError as error:
        raise NativeBuildError(f"cannot write the build cache {cache_dir}: {error}") from error
    try:
        _compile(cc, flags, sources, staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("built native attention: %s", target)
    return target


def _compile(cc: str, flags: tuple[str, ...], sources: dict[str, bytes], staging: Path,
             target: Path) -> None:
    for name, text in sources.items():
        (staging / name).write_bytes(text)
    built = staging / "kernel.so"
    command = [cc, *flags, "-I", str(staging),
               *(str(staging / name) for name in sources if name.endswith(".c")), "-o", str(built), *LIBS]
    try:
        done = subprocess.run(command, capture_output=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise NativeBuildError(f"{cc} failed to build the native attention kernel (exit "
                                   f"{done.returncode}):\n{done.stderr.decode(errors='replace').strip()}")
        os.replace(built, target)  # atomic: concurrent builders each rename a complete file
    except subprocess.TimeoutExpired as error:
        raise NativeBuildError(f"building the native attention kernel took over {BUILD_TIMEOUT_S} s: "
                               f"{' '.join(command)}") from error
    except OSError as error:
        raise NativeBuildError(f"cannot build {target}: {error}") from error


def _compiler_version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeBuildError(f"cannot run the C compiler {cc!r}: {error}") from error
    if done.returncode != 0:
        raise NativeBuildError(f"{cc} --version failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _cpu_flags() -> str:
    """The flags line of /proc/cpuinfo: what -march=native compiled for."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        return platform.processor()
