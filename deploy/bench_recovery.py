"""`conveyor bench recovery`: how long a stream pauses when its worker or scheduler dies or hangs.

    conveyor bench recovery --trials 3 --kill-after-tokens 30

It launches conveyor (deploy.launcher.Stack, with the supervisor's watch that replaces lost
workers, as `conveyor serve` runs it), streams one greedy request per trial and SIGKILLs the worker
group's rank 0 when the stream has delivered --kill-after-tokens tokens. Per trial it reports the
pause from the kill to the next token (the one after the stream's longest gap: tokens computed
before the kill may still arrive first), split into the time until the new group serves (GET /health
is 200 again: the supervisor noticed, the worker started, loaded the weights and reported its KV
cache) and the rest (recomputing the prompt and the tokens already generated, then the next decode),
next to the stream's median inter-token latency.

    conveyor bench recovery --process scheduler --trials 3

SIGKILLs the scheduler instead, mid-stream: the supervisor replaces it with a fresh worker group and
the frontend resubmits the stream to the new scheduler, which recomputes prompt + tokens so far.
Per trial: the pause from the kill to the next token, and the time until the frontend had
resubmitted (its conveyor:process_restarts_total{process="scheduler"} went up: the new scheduler
and its workers had started and the scheduler had sent its first message).

    conveyor bench recovery --process frontend --trials 5

SIGKILLs the frontend instead, with no request in flight, and reports per trial the time from the
kill until GET /health answers 200 again (the supervisor noticed the exit, started a new frontend
on the same port, which loaded the tokenizer, said hello to the scheduler and reported ready).

    conveyor bench recovery --fault hang --step-timeout 30 --trials 3
    conveyor bench recovery --process scheduler --fault hang --trials 3

SIGSTOPs the process instead of killing it: it stays, silent, and must be found hung. A stopped
worker is found by the scheduler when the step outlives --step-timeout; a stopped scheduler by the
frontend, once it has heard nothing (no step, no heartbeat) for 10 s. Per trial, beside the times
above: the pause until GET /health turned 503, and what it said (for a worker, `stalled` once the
step's workers have used no CPU for --stall-timeout; for a scheduler, `engine_unavailable` after 5 s of silence,
before the frontend reports it at 10 s).

    conveyor bench recovery --url http://127.0.0.1:8000 --pid 4242 [--fault hang]

Launches nothing: one trial against a server already running, the fault going to the process
--pid (of the kind --process names) on this machine, such as a rank of node 1 when two "nodes"
run on one machine (docs/multi-node.md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from deploy.bench_sweep import free_port
from deploy.launcher import Stack, StartupError
from deploy.model_info import ModelError, read_model_info
from deploy.model_source import resolve_model
from proto.config import DTYPE_CHOICES, EngineConfig

PROMPT = "Write a long story about a lighthouse keeper and the ships she watches."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=None,
                        help="HF model directory or cached id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=EngineConfig().dtype)
    parser.add_argument("--process", choices=("worker", "scheduler", "frontend"), default="worker",
                        help="the process to fault once per trial")
    parser.add_argument("--fault", choices=("kill", "hang"), default="kill",
                        help="kill: SIGKILL; hang: SIGSTOP (worker or scheduler), so that it must be found hung")
    parser.add_argument("--step-timeout", type=float, default=EngineConfig().step_timeout_s,
                        help="seconds a step may take before its ranks count as hung (as serve's --step-timeout)")
    parser.add_argument("--stall-timeout", type=float, default=EngineConfig().stall_timeout_s,
                        help="seconds a step's workers may use no CPU before /health says 'stalled' (as serve's "
                             "--stall-timeout)")
    parser.add_argument("--trials", type=int, default=None, help="trials, one fault each (3; 1 with --url)")
    parser.add_argument("--kill-after-tokens", type=int, default=30,
                        help="text chunks (a token each, mostly) streamed before the fault")
    parser.add_argument("--max-tokens", type=int, default=120, help="tokens per stream (ignore_eos)")
    parser.add_argument("--port", type=int, default=0, help="server port (0 = any free port)")
    parser.add_argument("--url", default=None,
                        help="time a server that is already running instead (a multi-node deployment's node 0): "
                             "launch nothing, fault the process --pid, one trial")
    parser.add_argument("--pid", type=int, default=0,
                        help="with --url: the process on this machine to kill or stop, of the kind --process names")


def run(args: argparse.Namespace) -> int:
    if args.trials is None:
        args.trials = 1 if args.url else 3
    if not 0 < args.kill_after_tokens < args.max_tokens or args.trials < 1:
        print(f"conveyor bench recovery: need 0 < --kill-after-tokens ({args.kill_after_tokens}) < "
              f"--max-tokens ({args.max_tokens}) and --trials >= 1", file=sys.stderr)
        return 2
    if args.fault == "hang" and args.process == "frontend":
        print("conveyor bench recovery: --fault hang takes --process worker or scheduler (a frontend is "
              "watched for hangs only while it starts)", file=sys.stderr)
        return 2
    if args.url:
        return _attached(args)
    try:
        config = _config(args)
        with Stack(config) as stack, _watched(stack):
            config = stack.config  # with the dtype resolved
            if args.process == "frontend":
                trials = [_frontend_trial(stack) for _ in range(args.trials)]
            else:
                victim = functools.partial(_pid_of, stack, args.process)
                trials = [_trial(stack.url, stack.config.served_model_name, victim, args)
                          for _ in range(args.trials)]
    except (ModelError, StartupError, OSError, RuntimeError, httpx.HTTPError) as exc:
        print(f"conveyor bench recovery: {exc}", file=sys.stderr)
        return 1
    return _report(args, config.model, config.dtype, config, trials)


def _pid_of(stack: Stack, process: str) -> int:
    """The scheduler's pid, or the worker group's rank 0's (as it is now: replacements get new ones)."""
    module = "scheduler_proc" if process == "scheduler" else "worker_proc"
    return next(child.process.pid for child in stack.children if child.module == module)


def _attached(args: argparse.Namespace) -> int:
    """One trial against the server at --url, the fault going to process --pid."""
    if not args.pid or args.trials != 1 or args.process == "frontend":
        print("conveyor bench recovery: --url takes --pid (the worker or scheduler to fault), --trials 1 "
              "and --process worker or scheduler", file=sys.stderr)
        return 2
    try:
        model = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]["id"]
        dtype = httpx.get(f"{args.url}/version", timeout=10).json()["dtype"]
        trials = [_trial(args.url, model, lambda: args.pid, args)]
    except (httpx.HTTPError, OSError, RuntimeError, KeyError, IndexError) as exc:
        print(f"conveyor bench recovery: {exc}", file=sys.stderr)
        return 1
    return _report(args, model, dtype, None, trials)  # the server's own timeouts apply


def _report(args: argparse.Namespace, model: str, dtype: str, config: EngineConfig | None,
            trials: list[dict]) -> int:
    key = "kill_to_health_200_s" if args.process == "frontend" else f"{args.fault}_to_next_token_s"
    summary = {"model": model, "dtype": dtype, "process": args.process, "fault": args.fault,
               "step_timeout_s": config and config.step_timeout_s,
               "stall_timeout_s": config and config.stall_timeout_s, "trials": trials,
               f"{key}_median": statistics.median(t[key] for t in trials), "command": " ".join(sys.argv)}
    print(json.dumps(summary, indent=2))
    return 0


def _config(args: argparse.Namespace) -> EngineConfig:
    model_dir = resolve_model(args.model_dir)
    info = read_model_info(model_dir)
    # The launcher resolves max_model_len, vocab_size and the served name from the model.
    return EngineConfig(model=str(model_dir), dtype=args.dtype, eos_token_ids=info.eos_token_ids,
                        port=args.port or free_port(), log_level="warning", step_timeout_s=args.step_timeout,
                        stall_timeout_s=args.stall_timeout,
                        max_restarts=max(EngineConfig().max_restarts, args.trials))


@contextmanager
def _watched(stack: Stack) -> Iterator[None]:
    """The supervisor's watch in a thread, so that a killed worker group is replaced."""
    stop = threading.Event()
    thread = threading.Thread(target=stack.watch, args=(stop.is_set, 0.2), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def _trial(url: str, model: str, victim: Callable[[], int], args: argparse.Namespace) -> dict:
    """One greedy stream; at --kill-after-tokens the fault goes to process victim()."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stamps: list[float] = []  # when each chunk that carries text arrived
    fault_at, finish_reason, watch, pid = 0.0, None, _Watch(url, args.process), 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: "):])["choices"][0]
                finish_reason = choice["finish_reason"] or finish_reason
                if not choice["text"]:
                    continue
                stamps.append(time.monotonic())
                if len(stamps) == args.kill_after_tokens:
                    watch.read_baseline()
                    watch.start()
                    pid = victim()
                    os.kill(pid, signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
                    fault_at = time.monotonic()
        watch.join(timeout=30)  # the stream is over: the server answered again long ago
    finally:
        watch.stop.set()
        if pid and args.fault == "hang":  # a stopped process nobody replaced must not stay stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    if finish_reason != "length" or not fault_at:
        raise RuntimeError(f"the stream ended with finish_reason {finish_reason!r} after {len(stamps)} "
                           f"chunks (fault injected: {bool(fault_at)})")
    # The pause is the longest gap after the fault: tokens computed before it may still arrive first.
    pairs = [(a, b) for a, b in zip(stamps, stamps[1:]) if b > fault_at]
    _, next_token = max(pairs, key=lambda pair: pair[1] - max(pair[0], fault_at))
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b != next_token]
    serving = "resubmitted" if args.process == "scheduler" else "serving"
    serving_at = watch.resubmitted_at if args.process == "scheduler" else watch.serving_at

    def since_fault(at: float) -> float | None:
        return round(at - fault_at, 3) if at else None

    fault = args.fault  # kill_to_... or hang_to_...
    return {f"{fault}_to_next_token_s": round(next_token - fault_at, 3),
            f"{fault}_to_unhealthy_s": since_fault(watch.unhealthy_at), "unhealthy_status": watch.unhealthy_status,
            f"{fault}_to_{serving}_s": since_fault(serving_at),
            f"{serving}_to_next_token_s": round(next_token - serving_at, 3) if serving_at else None,
            "median_itl_s": round(statistics.median(gaps), 4)}


def _frontend_trial(stack: Stack) -> dict:
    """SIGKILL the frontend; seconds until /health is 200 again (polled every 20 ms)."""
    frontend = next(child for child in stack.children if child.name == "frontend")
    old_pid = frontend.process.pid
    os.kill(old_pid, signal.SIGKILL)
    killed_at, deadline = time.monotonic(), time.monotonic() + 300
    while time.monotonic() < deadline:
        restarted = frontend.process.pid != old_pid  # the supervisor replaced it
        try:
            up = restarted and httpx.get(f"{stack.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            up = False
        if up:
            return {"kill_to_health_200_s": round(time.monotonic() - killed_at, 3)}
        time.sleep(0.02)
    raise RuntimeError("the frontend did not come back within 300 s")


class _Watch(threading.Thread):
    """Polls the server every 50 ms from just before the fault: when GET /health first turned
    non-200 (`unhealthy_at`) and 200 again after that (`serving_at`: the new group serves), and for
    a scheduler fault when the frontend counted one more replaced scheduler (`resubmitted_at`: it
    resubmits at that moment). Each is stamped when the request that saw it was sent."""

    def __init__(self, url: str, process: str) -> None:
        super().__init__(daemon=True)
        self.url, self.process = url, process
        self.unhealthy_at = self.serving_at = self.resubmitted_at = 0.0
        self.unhealthy_status = ""  # what /health said first when it turned non-200
        self.stop = threading.Event()
        self._restarts_before = 0.0

    def read_baseline(self) -> None:
        """Before the fault: how many replaced schedulers the frontend has counted so far."""
        if self.process == "scheduler":
            self._restarts_before = self._scheduler_restarts()
            if self._restarts_before < 0:
                raise RuntimeError(f"{self.url}/metrics does not answer before the fault")

    def run(self) -> None:
        deadline, done = time.monotonic() + 300, False
        while not done and not self.stop.is_set() and time.monotonic() < deadline:
            asked_at = time.monotonic()
            if self.process == "scheduler" and not self.resubmitted_at and \
                    self._scheduler_restarts() > self._restarts_before:
                self.resubmitted_at = asked_at
            asked_at = time.monotonic()
            status, said = self._health()
            if status != 200 and not self.unhealthy_at:
                self.unhealthy_at, self.unhealthy_status = asked_at, said
            elif status == 200 and self.unhealthy_at and not self.serving_at:
                self.serving_at = asked_at
            # A replaced scheduler may come back before /health noticed it was gone.
            done = bool(self.resubmitted_at and status == 200) if self.process == "scheduler" else bool(self.serving_at)
            self.stop.wait(0.05)

    def _health(self) -> tuple[int, str]:
        try:
            response = httpx.get(f"{self.url}/health", timeout=5)
            return response.status_code, response.json().get("status", "")
        except (httpx.HTTPError, ValueError):
            return 0, "no answer"

    def _scheduler_restarts(self) -> float:
        """conveyor:process_restarts_total{process="scheduler"}: 0 when absent, -1 when /metrics
        does not answer."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=5).text
        except httpx.HTTPError:
            return -1.0
        for line in text.splitlines():
            if line.startswith("conveyor:process_restarts_total{") and 'process="scheduler"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0
