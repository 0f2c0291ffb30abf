"""Benchmark summaries (throughput, latency percentiles) and PNG plots from replayed requests."""

from __future__ import annotations

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


def write_plots(result: dict, out_dir: Path, label: str) -> list[Path]:
    """Latency CDFs and output tokens/s over time, as PNGs next to the result JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = [r for r in result["requests"] if not r["error"] and r["token_times_s"]]
    series = {
        "TTFT": [r["token_times_s"][0] - r["start_s"] for r in requests],
        "end-to-end": [r["end_s"] - r["start_s"] for r in requests],
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in series.items():
        values = np.sort(values)
        ax.plot(values, np.linspace(0, 1, len(values), endpoint=False), label=name)
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"latency CDF: {label}")
    ax.legend()
    cdf_path = out_dir / f"{label}-latency-cdf.png"
    fig.savefig(cdf_path, dpi=100, bbox_inches="tight")
    plt.close(fig)

    times = np.concatenate([r["token_times_s"] for r in requests]) if requests else np.zeros(0)
    fig, ax = plt.subplots(figsize=(6, 3))
    if len(times):
        bins = np.arange(0.0, float(times.max()) + 1.0, 1.0)
        ax.hist(times, bins=bins)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("streamed chunks / s")
    ax.set_title(f"output over time: {label}")
    rate_path = out_dir / f"{label}-tokens-over-time.png"
    fig.savefig(rate_path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [cdf_path, rate_path]
