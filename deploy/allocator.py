"""The CPU workers' memory allocator: glibc's malloc, or tcmalloc preloaded when asked.

Every op of a step allocates its output and frees its inputs, blocks of kilobytes to megabytes
whose sizes follow the batch; tcmalloc keeps freed spans in per-size lists for reuse. Measured
here (docs/benchmarks.md, "Allocator"): 3-9% faster on bursts of short decodes, no change on
prompt-heavy bursts or a single stream, so glibc stays the default. CONVEYOR_MALLOC picks:
system (the default), tcmalloc (refuse to start where none is installed), auto (tcmalloc where
installed). The supervisor sets it for CPU workers only.
"""

from __future__ import annotations

import ctypes.util
import functools
from collections.abc import Callable
from pathlib import Path

from proto.errors import ValidationError

CHOICES = ("auto", "tcmalloc", "system")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/lib")


@functools.cache
def find_tcmalloc(library_dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    """The path of an installed tcmalloc (the minimal build first), or None."""
    for name in ("tcmalloc_minimal", "tcmalloc"):
        soname = ctypes.util.find_library(name)  # e.g. libtcmalloc_minimal.so.4, from ldconfig's cache
        if soname is None:
            continue
        for directory in library_dirs:
            if (Path(directory) / soname).is_file():
                return str(Path(directory) / soname)
    return None


def allocator_env(environ: dict[str, str],
                  find: Callable[[], str | None] = find_tcmalloc) -> dict[str, str]:
    """LD_PRELOAD for a CPU worker, given CONVEYOR_MALLOC; find() (the tcmalloc installed, or None)
    runs only when it asks for tcmalloc, so the default start-up reads no library cache. An
    LD_PRELOAD of the caller's own is kept as it is."""
    choice = environ.get("CONVEYOR_MALLOC", "system")
    if choice not in CHOICES:
        raise ValidationError(f"CONVEYOR_MALLOC must be one of {CHOICES}, got {choice!r}", "CONVEYOR_MALLOC")
    if choice == "system":
        return {}
    tcmalloc = find()
    if choice == "tcmalloc" and tcmalloc is None:
        raise ValidationError("CONVEYOR_MALLOC=tcmalloc, but no libtcmalloc is installed (Debian and "
                              "Ubuntu: apt install libtcmalloc-minimal4); unset it for glibc's malloc",
                              "CONVEYOR_MALLOC")
    if tcmalloc is None or environ.get("LD_PRELOAD"):
        return {}
    return {"LD_PRELOAD": tcmalloc}
