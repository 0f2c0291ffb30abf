"""A SIGKILLed supervisor's runtime directory is removed at the next start; no live one ever is."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from deploy.runtime_dirs import OWNER_FILE, make_owned_runtime_dir, remove_stale_runtime_dirs


def a_dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def runtime_dir(base: Path, name: str, owner: int | None) -> Path:
    path = base / f"conveyor-{name}"
    path.mkdir()
    (path / "control.sock").write_text("")
    if owner is not None:
        (path / OWNER_FILE).write_text(str(owner))
    return path


def test_only_directories_whose_owner_is_gone_are_removed(tmp_path: Path) -> None:
    gone = runtime_dir(tmp_path, "gone", a_dead_pid())
    live = runtime_dir(tmp_path, "live", os.getpid())
    unowned = runtime_dir(tmp_path, "unowned", None)  # a test's or a tool's, or one being made
    garbled = runtime_dir(tmp_path, "garbled", None)
    (garbled / OWNER_FILE).write_text("not a pid")
    listened = runtime_dir(tmp_path, "listened", a_dead_pid())  # another PID namespace's live supervisor
    (listened / "control.sock").unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(listened / "control.sock"))
    listener.listen()
    other = tmp_path / "other-dir"
    other.mkdir()
    (other / OWNER_FILE).write_text(str(a_dead_pid()))
    try:
        assert remove_stale_runtime_dirs(tmp_path) == [gone]
        assert not gone.exists() and all(path.exists() for path in (live, unowned, garbled, listened, other))
        assert remove_stale_runtime_dirs(tmp_path) == []
    finally:
        listener.close()
    assert remove_stale_runtime_dirs(tmp_path) == [listened]  # nothing listens there any more


def test_the_supervisors_runtime_dir_names_it_and_is_private() -> None:
    path = Path(make_owned_runtime_dir())
    try:
        assert (path / OWNER_FILE).read_text() == str(os.getpid())
        assert path.name.startswith("conveyor-") and path.stat().st_mode & 0o777 == 0o700
        assert path not in remove_stale_runtime_dirs(path.parent)  # its owner, this process, lives
    finally:
        (path / OWNER_FILE).unlink()
        path.rmdir()
