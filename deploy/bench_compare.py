"""`conveyor bench compare`: the same traces against several OpenAI-compatible servers, side by side.

    conveyor bench compare --trace heavy.jsonl --trace uniform.jsonl --rounds 2 \\
        --server conveyor='conveyor serve --port {port}' \\
        --server vllm='../shared/peers/vllm-cpu.sh ~/.cache/conveyor/models/SmolLM2-135M-Instruct {port} float32'

One server runs at a time, alone on the machine: each round starts every server in turn (the
order reversed every other round, ABBA, so that a host that drifts favours none), replays every
trace against it (bench's replay: prompts as token ids, ignore_eos, temperature 0) while sampling
the resident memory of its whole process tree, and stops it. `{port}` in a command is a free port;
a command runs the server in the foreground, or starts it in the background and prints `pid=N`.
Each run's summary goes to --result-dir as JSON; compare.json and compare.md hold them all, the
CPU, and the first server's output tok/s over each other's, on the means of their rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from statistics import mean

from deploy.bench_sweep import free_port
from deploy.replay import BenchError, ReplayOptions, add_replay_arguments, replay, replay_options
from deploy.server_process import PeakRss, ServerError, ServerProcess
from proto.trace import load_trace

SERVER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,40}")
ISA_FLAGS = re.compile(r"^(avx2|avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_ne_convert)$")


def server_spec(text: str) -> tuple[str, str]:
    """NAME=COMMAND -> (name, command); the command must take the port."""
    name, sep, command = text.partition("=")
    if not sep or not SERVER_NAME.fullmatch(name) or not command.strip():
        raise argparse.ArgumentTypeError(f"--server takes NAME=COMMAND (NAME of letters, digits, '_.-'), "
                                         f"got {text!r}")
    if "{port}" not in command:
        raise argparse.ArgumentTypeError(f"--server {name}: the command must contain {{port}}, where the "
                                         f"server is to listen, got {command!r}")
    return name, command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, action="append", required=True,
                        help="a trace file (conveyor bench --save-trace); repeat for several")
    parser.add_argument("--server", type=server_spec, action="append", required=True, metavar="NAME=COMMAND",
                        help="a server and the shell command that starts it, with {port}; repeat for several")
    parser.add_argument("--rounds", type=int, default=2, help="starts of each server, in ABBA order (default 2)")
    parser.add_argument("--start-timeout", type=float, default=900.0,
                        help="seconds to wait for /health and /v1/models to answer 200")
    parser.add_argument("--stop-timeout", type=float, default=60.0, help="seconds before SIGKILL")
    add_replay_arguments(parser)
    parser.add_argument("--result-dir", type=Path, default=Path("bench-results/compare"),
                        help="one JSON per run, compare.json, compare.md and each start's log")


def run_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, server) in the order they run: ABBA (every other round reversed)."""
    return [(r, name) for r in range(1, rounds + 1) for name in (names if r % 2 else names[::-1])]


def run(args: argparse.Namespace) -> int:
    commands = dict(args.server)
    try:
        if len(commands) != len(args.server):
            raise ValueError("each --server needs a name of its own")
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
        options = replay_options(args)
        traces = {path.stem: load_trace(path) for path in args.trace}
        if len(traces) != len(args.trace):
            raise ValueError("each --trace needs a file name (stem) of its own: runs are named by it")
    except (ValueError, OSError) as exc:
        print(f"conveyor bench compare: {exc}", file=sys.stderr)
        return 2
    args.result_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for round_index, name in run_order(list(commands), args.rounds):
        try:
            runs += _one_start(name, commands[name], round_index, traces, args, options)
        except (ServerError, BenchError) as exc:
            print(f"conveyor bench compare: {exc}", file=sys.stderr)
            return 1
    summary = {"cpu": cpu_summary(), "servers": commands, "traces": [str(p) for p in args.trace],
               "rounds": args.rounds, "runs": runs, "ratios": ratios(runs, list(commands)),
               "command": " ".join(sys.argv)}
    (args.result_dir / "compare.json").write_text(json.dumps(summary, indent=2))
    table = format_markdown(summary)
    (args.result_dir / "compare.md").write_text(table + "\n")
    print(table)
    return 0 if all(r["errors"] == 0 for r in runs) else 1


def _one_start(name: str, command: str, round_index: int, traces: dict, args: argparse.Namespace,
               options: ReplayOptions) -> list[dict]:
    port = free_port()
    server = ServerProcess(name, command.replace("{port}", str(port)), port,
                           args.result_dir / f"{name}-round{round_index}.log")
    print(f"round {round_index}: starting {name} on port {port}", file=sys.stderr)
    runs = []
    try:
        startup_s = server.start(args.start_timeout)
        for trace_name, entries in traces.items():
            with PeakRss(server) as rss:
                result = asyncio.run(replay(entries, server.url, None, options))
            result.pop("requests")
            result.update(server=name, round=round_index, trace=trace_name, startup_s=round(startup_s, 1),
                          peak_rss_bytes=rss.peak_bytes, server_command=server.command)
            (args.result_dir / f"{trace_name}-{name}-round{round_index}.json").write_text(json.dumps(result, indent=2))
            print(f"{trace_name} {name} round {round_index}: {result['duration_s']} s, "
                  f"{result['output_tok_per_s']} output tok/s", file=sys.stderr)
            runs.append(result)
    finally:
        server.stop(args.stop_timeout)
    return runs


def ratios(runs: list[dict], names: list[str]) -> dict[str, dict[str, float]]:
    """Per trace: the first server's output tok/s over each other's, on the means of their rounds."""
    found: dict[str, dict[str, float]] = {}
    for trace in dict.fromkeys(r["trace"] for r in runs):
        means = {name: mean(r["output_tok_per_s"] for r in runs if r["trace"] == trace and r["server"] == name)
                 for name in names if any(r["trace"] == trace and r["server"] == name for r in runs)}
        first = means.get(names[0])
        if first is not None:
            found[trace] = {name: round(first / value, 3) for name, value in means.items()
                            if name != names[0] and value > 0}
    return found


def cpu_summary() -> dict[str, object]:
    """This machine's CPU model, core count and vector/matrix ISA flags (each figure's context)."""
    model, flags, cores = "", set(), 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags":
                flags |= {flag for flag in value.split() if ISA_FLAGS.match(flag)}
            elif key == "processor":
                cores += 1
    except OSError:
        pass
    return {"model": model, "cores": cores, "isa_flags": sorted(flags)}


def format_markdown(summary: dict) -> str:
    """The runs as docs/benchmarks.md tables them, then the ratios."""
    cpu = summary["cpu"]
    lines = [f"CPU: {cpu['model']}, {cpu['cores']} cores, {' '.join(cpu['isa_flags']) or 'no AVX2'}", "",
             "| trace | server, round | duration | output tok/s | TTFT p50 / p99 | TPOT p50 / p99 | "
             "ITL p50 / p99 | e2e p50 / p99 | peak RSS | start-up |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        cells = [r["trace"], f"{r['server']}, {r['round']}", f"{r['duration_s']:.1f} s",
                 f"**{r['output_tok_per_s']:.1f}**", *(_pair(r[key]) for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s")),
                 f"{r['peak_rss_bytes'] / 2**30:.1f} GiB", f"{r['startup_s']:.0f} s"]
        if r["errors"]:
            cells[3] += f" ({r['errors']} errors)"
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    first = next(iter(summary["servers"]))
    for trace, by_server in summary["ratios"].items():
        lines.append(f"{trace}: {first}'s output tok/s (mean of its rounds) is "
                     + ", ".join(f"{value:.2f}x {name}'s" for name, value in by_server.items()))
    return "\n".join(lines)


def _pair(percentiles: dict) -> str:
    """p50 / p99, in ms when both are under a second (a single stream's TPOT)."""
    p50, p99 = percentiles["p50"], percentiles["p99"]
    if p50 is None:
        return "-"
    return f"{p50 * 1e3:.1f} / {p99 * 1e3:.1f} ms" if p99 < 1.0 else f"{p50:.2f} / {p99:.2f} s"
