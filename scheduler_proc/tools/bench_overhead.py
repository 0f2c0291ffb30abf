"""Null-model overhead benchmark: schedule + encode + send + receive + update, per step.

    python -m scheduler_proc.tools.bench_overhead --num-seqs 256 --steps 200

Runs the real SchedulerEngine and codec against a real null-model worker process over ipc
sockets (the worker samples without a model), with every request running at once, and reports
the per-step time of each phase. No HTTP and no frontend: this is the engine's own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import zmq

from proto import codec, sockets
from proto.config import EngineConfig
from proto.messages import AddRequest, StepResult, WorkerReady
from proto.sampling import SamplingParams
from scheduler_proc.engine import SchedulerEngine

PHASES = ("schedule", "encode", "send_recv", "decode", "update", "total")


def _start_worker(config: EngineConfig) -> subprocess.Popen:
    argv = [sys.executable, "-m", "worker_proc", "--config", config.to_json(), "--rank", "0"]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def _await_ready(results: zmq.Socket, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        frame = sockets.recv_ready(results, 0.5)
        if frame is not None:
            return codec.decode(frame, WorkerReady).num_kv_blocks
    raise RuntimeError(f"null worker not ready within {timeout_s} s")


def _add_requests(engine: SchedulerEngine, num_seqs: int, prompt_len: int, max_tokens: int) -> None:
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True, seed=1)
    for index in range(num_seqs):
        prompt = rng.integers(100, 1000, size=prompt_len, dtype=np.int32)
        engine.add(AddRequest(f"r{index}", prompt, params, time.time()))


def run_steps(engine: SchedulerEngine, plan_sock: zmq.Socket, results: zmq.Socket,
              num_seqs: int) -> dict[str, list[float]]:
    """Time every step in which all num_seqs requests are decoding."""
    timings: dict[str, list[float]] = {phase: [] for phase in PHASES}
    while engine.has_unfinished_requests:
        t0 = time.perf_counter()
        plan = engine.schedule()
        t1 = time.perf_counter()
        frame = codec.encode(plan)
        t2 = time.perf_counter()
        plan_sock.send(frame, copy=False)
        reply = results.recv()
        t3 = time.perf_counter()
        result = codec.decode(reply, StepResult)
        assert not result.error, result
        t4 = time.perf_counter()
        engine.apply_result(result)
        t5 = time.perf_counter()
        if plan.num_seqs == num_seqs and len(plan.input_ids) == num_seqs:  # steady-state decode
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
                timings[phase].append(seconds)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="decode steps per request")
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()
    runtime_dir = sockets.make_runtime_dir()
    config = EngineConfig(model="", null_model=True, vocab_size=49152, eos_token_ids=(2,),
                          max_num_seqs=args.num_seqs, max_num_batched_tokens=args.num_seqs * args.prompt_len,
                          num_kv_blocks=args.num_seqs * ((args.prompt_len + args.steps) // 16 + 2),
                          max_model_len=args.prompt_len + args.steps + 16, runtime_dir=runtime_dir)
    context = zmq.Context()
    control = sockets.bind(context, zmq.PULL, runtime_dir, sockets.CONTROL)
    plan_sock = sockets.bind(context, zmq.PUSH, runtime_dir, sockets.plan_channel(0))
    results = sockets.bind(context, zmq.PULL, runtime_dir, sockets.RESULTS)
    worker = _start_worker(config)
    try:
        engine = SchedulerEngine(config, _await_ready(results, 60.0))
        _add_requests(engine, args.num_seqs, args.prompt_len, args.steps)
        timings = run_steps(engine, plan_sock, results, args.num_seqs)
    finally:
        worker.terminate()
        worker.wait(10)
        control.close()
        context.destroy(linger=0)
        shutil.rmtree(runtime_dir, ignore_errors=True)
    summary = {phase: {"mean_ms": round(1e3 * float(np.mean(v)), 4),
                       "p50_ms": round(1e3 * float(np.percentile(v, 50)), 4),
                       "p99_ms": round(1e3 * float(np.percentile(v, 99)), 4)} for phase, v in timings.items()}
    print(json.dumps({"num_seqs": args.num_seqs, "steps_measured": len(timings["total"]),
                      "cpu_count": os.cpu_count(), "per_step": summary}, indent=2))


if __name__ == "__main__":
    main()
