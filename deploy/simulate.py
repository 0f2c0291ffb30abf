"""`conveyor simulate`: draw a workload with deploy's trace generator and run the scheduler's slot
simulator on it (static vs continuous batching), in its own process.

deploy may not import scheduler_proc, so the workload crosses as a trace file (proto.trace).
The trace flags are `conveyor bench`'s; every other flag goes to the simulator, which parses (and
refuses) its own: --num-slots, --step-ms, --within-steps, --out-dir, --no-plot.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from deploy.trace import TraceSpec, add_trace_arguments, trace_from_args
from proto.trace import save_trace

SIMULATOR_MODULE = "scheduler_proc.tools.simulate"
# 80 requests/s against the simulator's default 50 ms step: 4 arrivals a step on average, so the
# 64 requests arrive over the first ~16 steps and a queue forms behind 8 seats.
DEFAULTS = TraceSpec(num_prompts=64, prompt_len_min=1, prompt_len_max=1, output_median=16, output_max=256,
                     request_rate=80.0)


def trace_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor simulate", add_help=False, allow_abbrev=False,  # exact names: the rest is forwarded
        description="static vs continuous batching on the real scheduler, drawn as slot timelines",
        epilog="The simulator's own flags follow.")
    add_trace_arguments(parser, DEFAULTS)
    return parser


def run(argv: list[str]) -> int:
    """Draw (or load) the trace, write it to a file and run the simulator on it; its exit status."""
    parser = trace_parser()
    args, simulator_args = parser.parse_known_args(argv)
    if {"-h", "--help"} & set(simulator_args):
        print(parser.format_help(), flush=True)
        return _run_simulator(["--help"])
    try:
        entries = trace_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"conveyor simulate: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="conveyor-simulate-") as scratch:
        path = args.save_trace or Path(scratch) / "trace.jsonl"
        save_trace(entries, path)
        return _run_simulator(["--trace", str(path), *simulator_args])


def _run_simulator(simulator_args: list[str]) -> int:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    argv = [sys.executable, "-m", SIMULATOR_MODULE, *simulator_args]
    return subprocess.run(argv, stdin=subprocess.DEVNULL, env=env, check=False).returncode
