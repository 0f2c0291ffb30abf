"""The supervisor's launcher: clear start-up failures, clean stops, no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from support import children_of, free_port, tiny_config

from deploy.allocator import find_tcmalloc
from deploy.launcher import Stack, StartupError
from deploy.runtime_dirs import OWNER_FILE
from proto.processes import process_alive

ROOT = Path(__file__).resolve().parents[2]


def test_a_worker_that_cannot_load_the_model_fails_start_up_by_name(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    config = tiny_config(broken, ready_timeout_s=60)
    with pytest.raises(StartupError, match="worker0"):
        with Stack(config, log_dir=tmp_path / "logs"):
            pass


def test_a_kv_cache_too_small_for_max_model_len_fails_start_up_with_what_to_pass(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_model_dir, num_kv_blocks=8, max_model_len=512)  # 8 x 16 = 128 tokens
    with pytest.raises(StartupError, match=r"scheduler failed to start: max_model_len 512 needs 32 KV "
                                           r"blocks .* holds 8 blocks \(128 tokens\): pass --max-model-len 128"):
        with Stack(config, log_dir=tmp_path / "logs"):
            pass
    with Stack(config.with_updates(max_model_len=128, port=free_port()), log_dir=tmp_path / "fits") as stack:
        response = httpx.post(f"{stack.url}/v1/chat/completions", timeout=60,
                              json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0})
        assert response.status_code == 200, response.text  # no max_tokens: it may run to max_model_len


def test_a_stop_asked_for_during_start_up_ends_it_at_once_with_no_process_left(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    asked = {"stop": False}
    stack = Stack(tiny_config(tiny_model_dir), log_dir=tmp_path, should_stop=lambda: asked["stop"])
    spawn = stack._spawn

    def spawn_then_ask_to_stop(child) -> None:  # SIGTERM arrives once every process is started
        spawn(child)
        asked["stop"] = child.name == "frontend"

    stack._spawn = spawn_then_ask_to_stop
    started_s = time.monotonic()
    with pytest.raises(StartupError, match="asked to stop while .*frontend.* started"):
        with stack:
            pass
    assert time.monotonic() - started_s < 20  # not --ready-timeout (120 s)
    assert all(child.process.poll() is not None for child in stack.children)


def test_the_stack_stops_every_process_when_one_dies_with_no_restart_left(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    with Stack(tiny_config(tiny_model_dir, max_restarts=0), log_dir=tmp_path) as stack:
        pids = [child.process.pid for child in stack.children]
        scheduler = next(c for c in stack.children if c.name == "scheduler")
        scheduler.process.kill()
        reason = stack.watch(lambda: False, poll_s=0.1)
        assert "scheduler" in reason and "--max-restarts 0" in reason
    assert not any(process_alive(pid) for pid in pids)


def health_status(base_url: str) -> int | None:
    """/health's status code, or None while nothing answers."""
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


# SIGHUP: its terminal closed; under nohup (SIGHUP ignored) it serves on
@pytest.mark.parametrize("signum, nohup", [(signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGHUP, True)])
def test_conveyor_serve_stops_cleanly_on_sigterm(tiny_model_dir: Path, signum: int, nohup: bool) -> None:
    port = free_port()
    command = [sys.executable, "-m", "deploy.cli", "serve", str(tiny_model_dir), "--port", str(port),
               "--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1",
               "--max-num-seqs", "4", "--shutdown-timeout", "5"]
    # The server's SIGHUP as under nohup, or as from a terminal whatever this runner inherited (a
    # suite started under nohup passes SIG_IGN down to every child).
    hangups = signal.SIG_IGN if nohup else signal.SIG_DFL

    def set_hangups() -> None:
        signal.signal(signal.SIGHUP, hangups)
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, preexec_fn=set_hangups)
    try:
        deadline = time.monotonic() + 120
        while health_status(f"http://127.0.0.1:{port}") != 200:
            assert server.poll() is None, f"conveyor serve exited: {server.stdout.read()}"
            assert time.monotonic() < deadline, "conveyor serve did not answer /health with 200 in 120 s"
            time.sleep(0.3)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                              json={"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 200, response.text
        children = children_of(server.pid)
        assert len(children) >= 3
        server.send_signal(signum)
        signalled_s = time.monotonic()
        if not nohup:  # the supervisor wakes at once: the frontend drains, /health turns 503
            while health_status(f"http://127.0.0.1:{port}") == 200:
                time.sleep(0.01)
            assert time.monotonic() - signalled_s < 0.3
        if nohup:
            time.sleep(1.0)
            assert health_status(f"http://127.0.0.1:{port}") == 200  # the hangup is ignored, as nohup asks
            signum = signal.SIGTERM
            server.send_signal(signum)
        output, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, output
    assert str(tiny_model_dir) in output  # the model directory is logged at start-up
    assert f"received {signal.Signals(signum).name}; draining" in output
    assert not any(process_alive(pid) for pid in children)



def test_a_sigkilled_supervisors_runtime_dir_is_removed_when_the_next_one_starts(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", str(tiny_model_dir), "--port", str(port),
                               "--dtype", "float32", "--num-kv-blocks", "64", "--num-threads", "1"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while health_status(f"http://127.0.0.1:{port}") != 200:
            assert server.poll() is None and time.monotonic() < deadline, "conveyor serve did not start"
            time.sleep(0.3)
        owned = [path.parent for path in Path(tempfile.gettempdir()).glob(f"conveyor-*/{OWNER_FILE}")
                 if path.read_text() == str(server.pid)]
        assert len(owned) == 1 and (owned[0] / "control.sock").exists()
        children = children_of(server.pid)
        server.kill()  # no cleanup runs: the directory and its socket files stay behind
        server.wait()
        deadline = time.monotonic() + 30  # the children follow their supervisor out
        while any(process_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert owned[0].exists()
        with Stack(tiny_config(tiny_model_dir), log_dir=tmp_path):
            assert not owned[0].exists()
    finally:
        for pid in [server.pid, *children]:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.cpu_workers
@pytest.mark.skipif(find_tcmalloc() is None, reason="no libtcmalloc on this machine")
def test_conveyor_malloc_tcmalloc_is_preloaded_into_the_cpu_workers_only(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_MALLOC", "tcmalloc")
    with Stack(tiny_config(tiny_model_dir)) as stack:
        for child in stack.children:
            with open(f"/proc/{child.process.pid}/maps") as maps:
                assert ("tcmalloc" in maps.read()) == (child.module == "worker_proc"), child.name
        assert httpx.post(f"{stack.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                          timeout=60).status_code == 200


def test_a_bad_conveyor_malloc_stops_start_up_with_the_reason(tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_MALLOC", "jemalloc")
    with pytest.raises(StartupError, match="CONVEYOR_MALLOC must be one of"):
        with Stack(tiny_config(tiny_model_dir)):
            pass
