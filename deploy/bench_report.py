"""Benchmark summaries (throughput, latency percentiles) and PNG plots from replayed requests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize(records: list, duration_s: float) -> dict:
    """Throughput and latency percentiles over the requests that completed without error."""
    ok = [r for r in records if not r.error and r.token_times_s]
    output_tokens = sum(r.output_tokens or len(r.token_times_s) for r in ok)
    ttft = [r.token_times_s[0] - r.start_s for r in ok]
    e2e = [r.end_s - r.start_s for r in ok]
    tpot = [(r.end_s - r.token_times_s[0]) / (n - 1) for r in ok
            if (n := r.output_tokens or len(r.token_times_s)) > 1]
    itl = [b - a for r in ok for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": sorted({r.error for r in records if r.error})[:5],
        "duration_s": round(duration_s, 3),
        "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "output_tok_per_s": round(output_tokens / duration_s, 2) if duration_s > 0 else 0.0,
        "req_per_s": round(len(ok) / duration_s, 3) if duration_s > 0 else 0.0,
        "ttft_s": _percentiles(ttft),
        "tpot_s": _percentiles(tpot),
        "itl_s": _percentiles(itl),
        "e2e_s": _percentiles(e2e),
    }


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values, dtype=np.float64)
    out = {"mean": round(float(array.mean()), 5)}
    out.update({f"p{p}": round(float(np.percentile(array, p)), 5) for p in PERCENTILES})
    return out


def save_result(result: dict, out_dir: Path, filename: str) -> list[Path]:
    """The result JSON plus its PNG plots in `out_dir` (created); the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / filename
    json_path.write_text(json.dumps(result, indent=2))
    return [json_path, *write_plots(result, out_dir, Path(filename).stem)]


def latency_series(result: dict) -> dict[str, list[float]]:
    """Per-request (TTFT, TPOT, end-to-end) and per-token (ITL) latencies in seconds."""
    requests = [r for r in result["requests"] if not r["error"] and r["token_times_s"]]
    return {
        "TTFT": [r["token_times_s"][0] - r["start_s"] for r in requests],
        "end-to-end": [r["end_s"] - r["start_s"] for r in requests],
        "ITL": [b - a for r in requests for a, b in zip(r["token_times_s"], r["token_times_s"][1:])],
        "TPOT": [(r["end_s"] - r["token_times_s"][0]) / (len(r["token_times_s"]) - 1)
                 for r in requests if len(r["token_times_s"]) > 1],
    }


def write_plots(result: dict, out_dir: Path, label: str) -> list[Path]:
    """Latency CDFs and output tokens/s over time, as PNGs next to the result JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = latency_series(result)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, names, unit, scale in ((axes[0], ("TTFT", "end-to-end"), "s", 1.0),
                                   (axes[1], ("ITL", "TPOT"), "ms", 1e3)):
        for name in names:
            values = np.sort(np.asarray(series[name], dtype=np.float64)) * scale
            ax.plot(values, np.arange(1, len(values) + 1) / max(len(values), 1), label=name)
        ax.set_xlabel(unit)
        ax.set_ylabel("fraction")
        ax.legend()
    fig.suptitle(f"latency CDFs: {label}")
    cdf_path = out_dir / f"{label}-latency-cdf.png"
    fig.savefig(cdf_path, dpi=100, bbox_inches="tight")
    plt.close(fig)

    requests = [r for r in result["requests"] if not r["error"]]
    times = np.concatenate([r["token_times_s"] for r in requests] or [np.zeros(0)])  # float64 [num_chunks]
    fig, ax = plt.subplots(figsize=(6, 3))
    if len(times):
        ax.hist(times, bins=np.arange(0.0, float(times.max()) + 1.0, 1.0))
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("streamed tokens / s")
    ax.set_title(f"output over time: {label}")
    rate_path = out_dir / f"{label}-tokens-over-time.png"
    fig.savefig(rate_path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [cdf_path, rate_path]
