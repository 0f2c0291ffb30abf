"""`conveyor bench sweep`: throughput and P99 inter-token latency against --max-num-seqs, and the knee.

    conveyor bench sweep --max-num-seqs 1,2,4,8,16,32 --request-rate 4 --itl-target-ms 50

For each batch size it launches a fresh conveyor (deploy.launcher.Stack) on the model, replays
the same Poisson trace at the same rate, and stops the server. The knee is the largest batch
size whose P99 inter-token latency stays under the target (scanning upward, up to the first
that breaks it): past it, a bigger batch buys throughput with latency the target does not allow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import sys
from pathlib import Path

from deploy.launcher import Stack, StartupError
from deploy.model_info import ModelError, read_model_info, resolve_model_facts
from deploy.model_source import resolve_model
from deploy.replay import BenchError, ReplayOptions, add_replay_arguments, replay, replay_options
from deploy.trace import TraceSpec, add_trace_arguments, trace_from_args
from proto.config import DTYPE_CHOICES, SCHEDULING_POLICIES, EngineConfig
from proto.errors import ValidationError
from proto.trace import TraceEntry, save_trace


def batch_sizes(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (sorted, unique, each >= 1)."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers >= 1, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser, TraceSpec(request_rate=4.0))
    defaults = EngineConfig()
    parser.add_argument("--model-dir", default=None,
                        help="HF model directory or cached id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-num-seqs", type=batch_sizes, default=[1, 2, 4, 8, 16, 32],
                        help="comma-separated batch sizes to try (default 1,2,4,8,16,32)")
    parser.add_argument("--itl-target-ms", type=float, default=50.0, help="P99 inter-token latency target")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=defaults.dtype)
    parser.add_argument("--scheduling", choices=SCHEDULING_POLICIES, default=defaults.scheduling)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--num-kv-blocks", type=int, default=0, help="0 = from the memory budget")
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads per worker")
    parser.add_argument("--port", type=int, default=0, help="server port (0 = any free port)")
    parser.add_argument("--ready-timeout", type=float, default=defaults.ready_timeout_s)
    add_replay_arguments(parser)
    parser.add_argument("--result-dir", type=Path, default=Path("bench-results/sweep"),
                        help="sweep.json, sweep.png, one JSON and one log folder per batch size")


def find_knee(runs: list[dict], itl_target_ms: float) -> int | None:
    """The largest max_num_seqs that keeps P99 ITL within the target (and has no errors), scanning
    upward and stopping at the first that does not: a noisy pass beyond a failure is no knee."""
    knee = None
    for run in sorted(runs, key=lambda r: r["max_num_seqs"]):
        if run["errors"] or run["itl_p99_ms"] is None or run["itl_p99_ms"] > itl_target_ms:
            break
        knee = run["max_num_seqs"]
    return knee


def run(args: argparse.Namespace) -> int:
    try:
        if not args.itl_target_ms > 0:
            raise ValueError(f"--itl-target-ms must be > 0, got {args.itl_target_ms}")
        options = replay_options(args)
        base = _base_config(args)
        entries = trace_from_args(args, vocab_high=base.vocab_size)
        _check_fits(entries, base)
    except (ValueError, OSError, ModelError, ValidationError) as exc:
        print(f"conveyor bench sweep: {exc}", file=sys.stderr)
        return 2
    args.result_dir.mkdir(parents=True, exist_ok=True)
    save_trace(entries, args.save_trace or args.result_dir / "trace.jsonl")
    runs = []
    for max_num_seqs in args.max_num_seqs:
        try:
            runs.append(_one_batch_size(base.with_updates(max_num_seqs=max_num_seqs), entries, options,
                                        args.result_dir))
        except (StartupError, BenchError) as exc:
            print(f"conveyor bench sweep: --max-num-seqs {max_num_seqs}: {exc}", file=sys.stderr)
            return 1
    summary = _summary(args, base, runs)
    (args.result_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    plot_sweep(runs, args.itl_target_ms, summary["knee_max_num_seqs"], args.result_dir / "sweep.png")
    print(format_summary(summary))
    return 0 if all(r["errors"] == 0 for r in runs) else 1


def _base_config(args: argparse.Namespace) -> EngineConfig:
    model_dir = resolve_model(args.model_dir)
    info = read_model_info(model_dir)
    return resolve_model_facts(EngineConfig(
        model=str(model_dir), dtype=args.dtype,
        scheduling=args.scheduling, max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks, eos_token_ids=info.eos_token_ids, num_threads=args.num_threads,
        port=args.port, ready_timeout_s=args.ready_timeout, shutdown_timeout_s=10.0, log_level="warning"),
        info)


def _check_fits(entries: list[TraceEntry], config: EngineConfig) -> None:
    longest = max(len(e.prompt_token_ids) + e.output_len for e in entries)
    if longest > config.max_model_len:
        raise ValueError(f"the trace's longest request needs {longest} tokens (prompt + output) but the "
                         f"model's context is {config.max_model_len}; lower --prompt-len-max or --output-max")


def _one_batch_size(config: EngineConfig, entries: list[TraceEntry], options: ReplayOptions,
                    result_dir: Path) -> dict:
    label = f"seqs{config.max_num_seqs}"
    config = config.with_updates(port=config.port or free_port())
    print(f"max_num_seqs {config.max_num_seqs}: starting conveyor on port {config.port}", file=sys.stderr)
    with Stack(config, log_dir=result_dir / f"logs-{label}") as stack:
        result = asyncio.run(replay(entries, stack.url, config.served_model_name, options))
    result["max_num_seqs"] = config.max_num_seqs
    (result_dir / f"{label}.json").write_text(json.dumps(result, indent=2))
    itl_p99_s = result["itl_s"]["p99"]
    return {"max_num_seqs": config.max_num_seqs, "output_tok_per_s": result["output_tok_per_s"],
            "req_per_s": result["req_per_s"], "errors": result["errors"],
            "itl_p99_ms": None if itl_p99_s is None else round(1e3 * itl_p99_s, 3),
            "ttft_p99_ms": None if result["ttft_s"]["p99"] is None else round(1e3 * result["ttft_s"]["p99"], 3)}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a conveyor a benchmark launches)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _summary(args: argparse.Namespace, base: EngineConfig, runs: list[dict]) -> dict:
    return {"model": base.model, "dtype": base.dtype, "scheduling": base.scheduling,
            "num_prompts": args.num_prompts if not args.trace else None,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "itl_target_ms": args.itl_target_ms, "knee_max_num_seqs": find_knee(runs, args.itl_target_ms),
            "runs": runs, "command": " ".join(sys.argv)}


def format_summary(summary: dict) -> str:
    lines = [f"{'max_num_seqs':>12} {'output tok/s':>13} {'req/s':>8} {'P99 ITL ms':>11} {'errors':>7}"]
    for run in summary["runs"]:
        itl = "-" if run["itl_p99_ms"] is None else f"{run['itl_p99_ms']:.1f}"
        lines.append(f"{run['max_num_seqs']:>12} {run['output_tok_per_s']:>13.1f} {run['req_per_s']:>8.2f} "
                     f"{itl:>11} {run['errors']:>7}")
    knee, target = summary["knee_max_num_seqs"], summary["itl_target_ms"]
    lines.append(f"knee: max_num_seqs {knee} is the largest batch that keeps P99 ITL under {target:g} ms"
                 if knee is not None else f"knee: no batch size keeps P99 ITL under {target:g} ms")
    return "\n".join(lines)


def plot_sweep(runs: list[dict], itl_target_ms: float, knee: int | None, path: Path) -> Path:
    """Throughput (left axis) and P99 ITL (right axis) against max_num_seqs, target and knee marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["max_num_seqs"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(sizes, [r["output_tok_per_s"] for r in runs], "o-", color="tab:blue", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("--max-num-seqs (batch size)")
    ax.set_ylabel("output tokens / s", color="tab:blue")
    itl_ax = ax.twinx()
    itl_ax.plot(sizes, [r["itl_p99_ms"] if r["itl_p99_ms"] is not None else math.nan for r in runs],
                "s-", color="tab:red", label="P99 ITL")
    itl_ax.axhline(itl_target_ms, color="tab:red", linestyle=":", linewidth=1, label="ITL target")
    itl_ax.set_ylabel("P99 inter-token latency, ms", color="tab:red")
    itl_ax.set_ylim(bottom=0)
    if knee is not None:
        ax.axvline(knee, color="black", linestyle="--", linewidth=1, label="knee")
    handles = ax.get_legend_handles_labels()[0] + itl_ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_title(f"sweep: knee at max_num_seqs {knee} (P99 ITL target {itl_target_ms:g} ms)"
                 if knee is not None else f"sweep: no batch size meets P99 ITL {itl_target_ms:g} ms")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
