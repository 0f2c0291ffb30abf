"""`conveyor bench recovery`: how long a stream pauses when its worker is SIGKILLed, and of what.

    conveyor bench recovery --trials 3 --kill-after-tokens 30

It launches conveyor (deploy.launcher.Stack, with the supervisor's watch that replaces lost
workers, as `conveyor serve` runs it), streams one greedy request per trial and SIGKILLs the worker
group's rank 0 when the stream has delivered --kill-after-tokens tokens. Per trial it reports the
pause from the kill to the next token, split into the time until the new group serves (GET /health
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
kill until GET /health answers 200 again (the supervisor noticed within its 0.2 s watch poll,
started a new frontend on the same port, which loaded the tokenizer, said hello to the scheduler
and reported ready).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
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
                        help="the process to SIGKILL once per trial")
    parser.add_argument("--trials", type=int, default=3, help="trials, one kill each")
    parser.add_argument("--kill-after-tokens", type=int, default=30, help="tokens streamed before the kill")
    parser.add_argument("--max-tokens", type=int, default=120, help="tokens per stream (ignore_eos)")
    parser.add_argument("--port", type=int, default=0, help="server port (0 = any free port)")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.kill_after_tokens < args.max_tokens or args.trials < 1:
        print(f"conveyor bench recovery: need 0 < --kill-after-tokens ({args.kill_after_tokens}) < "
              f"--max-tokens ({args.max_tokens}) and --trials >= 1", file=sys.stderr)
        return 2
    try:
        config = _config(args)
        with Stack(config) as stack, _watched(stack):
            if args.process == "frontend":
                trials = [_frontend_trial(stack) for _ in range(args.trials)]
            else:
                trials = [_trial(stack, stack.config.served_model_name, args) for _ in range(args.trials)]
    except (ModelError, StartupError, OSError, RuntimeError) as exc:
        print(f"conveyor bench recovery: {exc}", file=sys.stderr)
        return 1
    key = "kill_to_health_200_s" if args.process == "frontend" else "kill_to_next_token_s"
    summary = {"model": config.model, "dtype": config.dtype, "process": args.process, "trials": trials,
               f"{key}_median": statistics.median(t[key] for t in trials), "command": " ".join(sys.argv)}
    print(json.dumps(summary, indent=2))
    return 0


def _config(args: argparse.Namespace) -> EngineConfig:
    model_dir = resolve_model(args.model_dir)
    info = read_model_info(model_dir)
    # The launcher resolves max_model_len, vocab_size and the served name from the model.
    return EngineConfig(model=str(model_dir), dtype=args.dtype, eos_token_ids=info.eos_token_ids,
                        port=args.port or free_port(), log_level="warning",
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


def _trial(stack: Stack, model: str, args: argparse.Namespace) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stamps: list[float] = []  # when each chunk that carries text arrived
    killed_at, serving_at, finish_reason = 0.0, [0.0], None
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            finish_reason = choice["finish_reason"] or finish_reason
            if not choice["text"]:
                continue
            stamps.append(time.monotonic())
            if len(stamps) == args.kill_after_tokens:
                killed_at = _kill(stack, args.process)
                watch = _await_resubmitted if args.process == "scheduler" else _await_serving
                threading.Thread(target=watch, args=(stack.url, serving_at), daemon=True).start()
    if finish_reason != "length" or not killed_at:
        raise RuntimeError(f"the stream ended with finish_reason {finish_reason!r} after {len(stamps)} "
                           f"chunks (killed: {bool(killed_at)})")
    next_token = min(t for t in stamps if t > killed_at)
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if not a <= killed_at < b]
    serving = "resubmitted" if args.process == "scheduler" else "serving"
    return {"kill_to_next_token_s": round(next_token - killed_at, 3),
            f"kill_to_{serving}_s": round(serving_at[0] - killed_at, 3) if serving_at[0] else None,
            f"{serving}_to_next_token_s": round(next_token - serving_at[0], 3) if serving_at[0] else None,
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


def _kill(stack: Stack, process: str) -> float:
    """SIGKILL the scheduler, or the worker group's rank 0."""
    module = "scheduler_proc" if process == "scheduler" else "worker_proc"
    victim = next(child for child in stack.children if child.module == module)
    os.kill(victim.process.pid, signal.SIGKILL)
    return time.monotonic()


def _await_resubmitted(url: str, resubmitted_at: list[float]) -> None:
    """Record when the frontend counts one more replaced scheduler (it resubmits at that moment;
    started right after the kill, long before the new scheduler can have spoken)."""
    before = _scheduler_restarts(httpx.get(f"{url}/metrics", timeout=5).text)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if _scheduler_restarts(httpx.get(f"{url}/metrics", timeout=5).text) > before:
                resubmitted_at[0] = time.monotonic()
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)


def _scheduler_restarts(metrics_text: str) -> float:
    """The value of conveyor:process_restarts_total{process="scheduler"} (0 when absent)."""
    for line in metrics_text.splitlines():
        if line.startswith("conveyor:process_restarts_total{") and 'process="scheduler"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _await_serving(url: str, serving_at: list[float]) -> None:
    """Record when /health turns 200 again after having been 503 (the new group serves)."""
    seen_down, deadline = False, time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{url}/health", timeout=5).status_code
        except httpx.HTTPError:
            status = 0
        seen_down = seen_down or status != 200
        if seen_down and status == 200:
            serving_at[0] = time.monotonic()
            return
        time.sleep(0.05)
