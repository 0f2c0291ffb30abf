"""A server started from a shell command, for `conveyor bench compare`: started, waited for until
its /health and /v1/models answer, measured (the resident memory of its whole process tree) and stopped.

The command either runs the server in the foreground (`conveyor serve --port 8123`) or starts it
in the background and exits 0 after printing `pid=N` (as ../shared/peers/vllm-cpu.sh does); then
N and its descendants are the server.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

PID_LINE = re.compile(r"\bpid=(\d+)\b")
POLL_S = 0.5


class ServerError(RuntimeError):
    """The server did not start (or left no process to measure); says which and why."""


class ServerProcess:
    """One start of one server; stop() ends every process of its tree, whatever happened before."""

    def __init__(self, name: str, command: str, port: int, log_path: Path) -> None:
        self.name, self.command, self.port, self.log_path = name, command, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._shell: subprocess.Popen | None = None
        self._roots: list[int] = []  # the processes whose trees are the server

    def start(self, timeout_s: float) -> float:
        """Run the command and wait until GET /health and /v1/models answer 200; the seconds that took."""
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self._shell = subprocess.Popen(self.command, shell=True, start_new_session=True,
                                           stdout=log, stderr=subprocess.STDOUT)
        self._roots = [self._shell.pid]
        while time.monotonic() - started < timeout_s:
            self._follow_launcher()
            if self._answers():
                return time.monotonic() - started
            time.sleep(POLL_S)
        raise ServerError(f"{self.name}: no 200 from {self.url}/health and /v1/models within {timeout_s:g} s of "
                          f"`{self.command}` (log: {self.log_path})")

    def _follow_launcher(self) -> None:
        """Once the command has exited (before its server answered, or after), the server is the pid
        it printed: a ServerError if it exited non-zero or printed none."""
        if self._shell is None or self._roots != [self._shell.pid] or self._shell.poll() is None:
            return
        status = self._shell.returncode
        found = PID_LINE.findall(self.log_path.read_text(errors="replace"))
        if status != 0 or not found:
            why = f"exited with status {status}" if status != 0 else "exited 0 without printing pid=N"
            raise ServerError(f"{self.name}: `{self.command}` {why} (log: {self.log_path})")
        self._roots = [int(found[-1])]

    def _answers(self) -> bool:
        """/health and /v1/models both 200: a server may list its models before its engine serves."""
        try:
            return all(httpx.get(f"{self.url}{path}", timeout=2.0).status_code == 200
                       for path in ("/health", "/v1/models"))
        except httpx.HTTPError:
            return False

    def pids(self) -> list[int]:
        """The live processes of the server: its roots and all their descendants."""
        self._follow_launcher()
        return process_tree(self._roots)

    def rss_bytes(self) -> int:
        return sum(_rss_bytes(pid) for pid in self.pids())

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to each root's process group (a server drains and stops its children), SIGKILL
        to whatever of the tree is left after timeout_s."""
        if self._shell is not None and self._shell.poll() is None:
            time.sleep(POLL_S)  # a launcher that prints pid=N exits just after its server answers
        try:
            pids = self.pids()
        except ServerError:  # the command failed; whatever it left still goes
            pids = process_tree(self._roots)
        for root in self._roots:
            try:
                os.killpg(os.getpgid(root), signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + timeout_s
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._shell is not None:
            self._shell.wait()


class PeakRss:
    """The largest RSS of a server's tree, sampled every interval_s in a thread while in `with`."""

    def __init__(self, server: ServerProcess, interval_s: float = 1.0) -> None:
        self._server, self._interval_s = server, interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, name=f"rss-{server.name}", daemon=True)
        self.peak_bytes = 0

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            try:
                self.peak_bytes = max(self.peak_bytes, self._server.rss_bytes())
            except ServerError:  # the command failed mid-run: the replay's errors tell that
                return
            if self._stopped.wait(self._interval_s):
                return


def process_tree(roots: list[int]) -> list[int]:
    """roots (those alive) and every live descendant, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid for pid in roots if _alive(pid)]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])  # fields after "(comm)": state, ppid, ...


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"  # a zombie has exited; only its parent's wait remains
