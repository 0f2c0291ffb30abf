"""Two "nodes" on one machine (a node-0 Stack and a worker-only Stack, TP=2, rank 1 on node 1):
rank 1 SIGKILLed mid-generation on node 1 makes both supervisors replace their ranks in a new
worker group that node 0 names, and 8 concurrent streams finish with an undisturbed run's text;
killed while nothing runs, the group is replaced before the next requests."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from support import caplog_of, free_port_block, metric_value, supervised, tiny_config
from integration.test_worker_recovery import run_burst

from deploy.launcher import Stack

pytestmark = pytest.mark.cpu_workers  # two nodes on one machine would share its first GPU


@contextmanager
def two_nodes(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Stack, Stack]]:
    """Node 1 first (it waits for node 0), each under its supervisor's watch."""
    base = tiny_config(tiny_model_dir, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                       master_port=free_port_block(5), insecure_transport=True, step_timeout_s=10.0,
                       ready_timeout_s=30.0)
    with ExitStack() as stacks:
        node1 = Stack(base.with_updates(node_rank=1), log_dir=tmp_path / "node1")
        node0 = Stack(base.with_updates(node_rank=0), log_dir=tmp_path / "node0")
        # Start node 1's workers before node 0 waits: Stack.start blocks until its own are ready.
        node1_started = stacks.enter_context(_started_in_background(node1))
        stacks.enter_context(node0)
        node1_started()
        stacks.enter_context(supervised(node1))
        stacks.enter_context(supervised(node0))
        yield node0, node1


@contextmanager
def _started_in_background(stack: Stack) -> Iterator:
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stack.__enter__)
        try:
            yield pending.result
        finally:
            stack.__exit__(None, None, None)


def _worker_pids(*stacks: Stack) -> set[int]:
    return {c.process.pid for stack in stacks for c in stack.children if c.module == "worker_proc"}


@contextmanager
def faulted_like_calm(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str,
                      fault: str) -> Iterator[tuple[Stack, Stack, list[str]]]:
    """The burst on two calm nodes, then on two nodes with `fault` in `variable` (once): the same
    texts, no error, and both nodes' ranks replaced in worker group 1. Yields the faulted nodes
    and the supervisors' log records."""
    with two_nodes(tiny_model_dir, tmp_path / "calm") as (node0, _node1):
        undisturbed = run_burst(node0.url)
    monkeypatch.setenv(variable, f"{fault},once={tmp_path / 'fired'}")
    with caplog_of("conveyor.deploy") as records, two_nodes(tiny_model_dir, tmp_path / "fault") as (node0, node1):
        old = _worker_pids(node0, node1)
        assert run_burst(node0.url) == undisturbed
        assert (tmp_path / "fired").exists()
        assert node0.config.worker_generation == node1.config.worker_generation == 1
        assert not _worker_pids(node0, node1) & old  # both nodes replaced their ranks
        assert metric_value(node0.url, "conveyor:request_success_total", finished_reason="error") == 0
        yield node0, node1, records


def test_a_remote_rank_killed_mid_generation_is_replaced_on_both_nodes_and_streams_finish_undisturbed(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with faulted_like_calm(tiny_model_dir, tmp_path, monkeypatch, "CONVEYOR_FAULT_INJECTION",
                           "rank=1,step=6,action=kill") as (node0, _node1, records):
        assert metric_value(node0.url, "conveyor:process_restarts_total", process="worker") == 1
    log = "\n".join(records)
    assert "worker1" in log and "SIGKILL" in log and "asking node 0 for a new group" in log, log
    assert "node 1 lost a rank" in log and "node 0 started worker group 1" in log, log


def test_a_scheduler_killed_mid_generation_is_replaced_with_a_group_both_nodes_join(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with faulted_like_calm(tiny_model_dir, tmp_path, monkeypatch, "CONVEYOR_SCHEDULER_FAULT",
                           "step=6,action=kill") as (_node0, _node1, records):
        pass
    log = "\n".join(records)
    assert "replacing the scheduler and the worker group with group 1" in log, log
    assert "node 0 started worker group 1 (the scheduler was replaced" in log, log


def test_a_remote_rank_killed_while_nothing_runs_is_replaced_on_both_nodes_before_the_next_requests(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    with two_nodes(tiny_model_dir, tmp_path / "calm") as (node0, _node1):
        undisturbed = run_burst(node0.url)
    with two_nodes(tiny_model_dir, tmp_path / "fault") as (node0, node1):
        old = _worker_pids(node0, node1)
        os.kill(next(iter(_worker_pids(node1))), signal.SIGKILL)
        codes, deadline = [], time.monotonic() + 60
        while codes[-1:] != [200] or 503 not in codes:
            assert time.monotonic() < deadline, f"/health said {codes}"
            codes.append(httpx.get(f"{node0.url}/health", timeout=5).status_code)
            time.sleep(0.05)
        assert node0.config.worker_generation == node1.config.worker_generation == 1
        assert not _worker_pids(node0, node1) & old
        assert run_burst(node0.url) == undisturbed
        assert metric_value(node0.url, "conveyor:process_restarts_total", process="worker") == 1
