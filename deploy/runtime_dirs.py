"""The supervisor's runtime directory (its ipc:// socket files) carries the supervisor's pid, so that
the directories of supervisors that are gone (SIGKILLed: their own cleanup never ran) are removed
at the next start on the machine instead of piling up in the temp directory. Gone means both: no
process has that pid here, and nothing listens on the directory's control socket (a supervisor of
another PID namespace sharing the temp directory still does)."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

from proto import sockets
from proto.processes import process_alive

OWNER_FILE = "supervisor.pid"


def make_owned_runtime_dir() -> str:
    """A fresh private runtime directory (sockets.make_runtime_dir) naming this process its owner."""
    path = sockets.make_runtime_dir()
    Path(path, OWNER_FILE).write_text(str(os.getpid()))
    return path


def remove_stale_runtime_dirs(base: Path | None = None) -> list[Path]:
    """Remove this user's conveyor-* directories in base (default: the temp directory) whose owner
    process no longer exists; returns them. A directory without an owner file (one a test or a
    tool made, or one whose supervisor is still writing it) or with a live owner is left alone."""
    base = Path(tempfile.gettempdir()) if base is None else base
    removed = []
    for path in sorted(base.glob("conveyor-*")):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            owner = int((path / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not process_alive(owner) and not _listening(path / f"{sockets.CONTROL}.sock"):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _listening(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket at path."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True
