"""`conveyor bench`: replay a trace against any OpenAI-compatible server, with streaming.

    conveyor bench --base-url http://127.0.0.1:8000 --num-prompts 256 --request-rate 4 --result-dir out
    conveyor bench sweep --max-num-seqs 1,4,16,64 --request-rate 4     (launches conveyor itself)
    conveyor bench recovery --trials 3       (launches conveyor, SIGKILLs or SIGSTOPs its worker mid-stream)
    conveyor bench recovery --process frontend   (SIGKILLs its frontend, times /health back to 200)
    conveyor bench compare --trace t.jsonl --server a='CMD {port}' --server b='CMD {port}'   (side by side, ABBA)

Flags follow `vllm bench serve` where they apply. The summary prints as JSON; with --result-dir
or --save-result the full result (every request's token times too) is written as JSON next to
PNG plots (latency CDFs, tokens/s over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from deploy import bench_compare, bench_recovery, bench_sweep
from deploy.bench_report import save_result
from deploy.replay import COMPLETIONS_ENDPOINT, BenchError, add_replay_arguments, replay, replay_options
from deploy.trace import add_trace_arguments, trace_from_args
from proto.trace import save_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=COMPLETIONS_ENDPOINT, help="completions path on the server")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    add_replay_arguments(parser)
    parser.add_argument("--result-dir", type=Path, default=None, help="write result JSON + PNGs here")
    parser.add_argument("--save-result", action="store_true",
                        help="write the result JSON and PNGs (to --result-dir, default: here)")
    parser.add_argument("--result-filename", default=None, help="default: LABEL.json")
    parser.add_argument("--label", default="run", help="name of this run in the result files")
    modes = parser.add_subparsers(dest="bench_mode", metavar="[sweep|recovery|compare]")
    bench_sweep.add_arguments(modes.add_parser(
        "sweep", help="launch conveyor at each --max-num-seqs and find the knee",
        description=bench_sweep.__doc__.splitlines()[0]))
    bench_recovery.add_arguments(modes.add_parser(
        "recovery", help="launch conveyor, kill or stop its worker or scheduler mid-stream (or kill its frontend), time the pause",
        description=bench_recovery.__doc__.splitlines()[0]))
    bench_compare.add_arguments(modes.add_parser(
        "compare", help="start each server in turn (ABBA), replay the same traces against it, table the runs",
        description=bench_compare.__doc__.splitlines()[0]))


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the bar
    if args.bench_mode == "sweep":
        return bench_sweep.run(args)
    if args.bench_mode == "recovery":
        return bench_recovery.run(args)
    if args.bench_mode == "compare":
        return bench_compare.run(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    try:
        options = replay_options(args, args.endpoint)
        entries = trace_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"conveyor bench: {exc}", file=sys.stderr)
        return 2
    if args.save_trace:
        save_trace(entries, args.save_trace)
    try:
        result = asyncio.run(replay(entries, base_url, args.model, options))
    except BenchError as exc:
        print(f"conveyor bench: {exc}", file=sys.stderr)
        return 1
    result["label"] = args.label
    result["command"] = " ".join(sys.argv)
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=2))
    if result["completed"] == 0:
        print(f"conveyor bench: every request to {base_url}{options.endpoint} failed; first error: "
              f"{result['error_samples'][0] if result['error_samples'] else 'no tokens streamed'}",
              file=sys.stderr)
    if args.result_dir or args.save_result:
        paths = save_result(result, args.result_dir or Path("."), args.result_filename or f"{args.label}.json")
        print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0 if result["errors"] == 0 else 1
