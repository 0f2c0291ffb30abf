"""`conveyor bench`: replay a trace against any OpenAI-compatible server, with streaming.

Each request sends its prompt as token ids to /v1/completions with `max_tokens` = the trace's
output length, `ignore_eos` and temperature 0, so every server does the same amount of work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from deploy.bench_report import summarize, write_plots
from deploy.trace import OUTPUT_DISTS, TraceEntry, TraceSpec, load_trace, make_trace, save_trace


@dataclass
class RequestRecord:
    """One replayed request, timed on this process's monotonic clock."""

    prompt_len: int
    output_len_asked: int
    start_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    end_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    spec = TraceSpec()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--num-prompts", type=int, default=spec.num_prompts)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests/s, Poisson arrivals (default inf: one burst)")
    parser.add_argument("--prompt-len-min", type=int, default=spec.prompt_len_min)
    parser.add_argument("--prompt-len-max", type=int, default=spec.prompt_len_max)
    parser.add_argument("--output-dist", choices=OUTPUT_DISTS, default=spec.output_dist,
                        help="heavy: lognormal output lengths; uniform: all the same length")
    parser.add_argument("--output-median", type=int, default=spec.output_median)
    parser.add_argument("--output-sigma", type=float, default=spec.output_sigma)
    parser.add_argument("--output-max", type=int, default=spec.output_max)
    parser.add_argument("--seed", type=int, default=spec.seed)
    parser.add_argument("--trace", type=Path, default=None, help="replay this JSONL trace instead")
    parser.add_argument("--save-trace", type=Path, default=None)
    parser.add_argument("--max-concurrency", type=int, default=0, help="0 = unlimited")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout, s")
    parser.add_argument("--result-dir", type=Path, default=None, help="write result JSON + PNGs here")
    parser.add_argument("--label", default="run", help="name of this run in the result files")


def run(args: argparse.Namespace) -> int:
    try:
        entries = _trace_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"conveyor bench: {exc}", file=sys.stderr)
        return 2
    if args.save_trace:
        save_trace(entries, args.save_trace)
    try:
        result = asyncio.run(replay(entries, args.base_url, args.model, args.max_concurrency, args.timeout))
    except BenchError as exc:
        print(f"conveyor bench: {exc}", file=sys.stderr)
        return 1
    result["label"] = args.label
    result["command"] = " ".join(sys.argv)
    print(json.dumps(result, indent=2))
    if args.result_dir:
        args.result_dir.mkdir(parents=True, exist_ok=True)
        (args.result_dir / f"{args.label}.json").write_text(json.dumps(result, indent=2))
        write_plots(result, args.result_dir, args.label)
    return 0 if result["errors"] == 0 else 1


def _trace_from_args(args: argparse.Namespace) -> list[TraceEntry]:
    if args.trace:
        return load_trace(args.trace)
    return make_trace(TraceSpec(
        num_prompts=args.num_prompts, prompt_len_min=args.prompt_len_min,
        prompt_len_max=args.prompt_len_max, output_dist=args.output_dist,
        output_median=args.output_median, output_sigma=args.output_sigma,
        output_max=args.output_max, request_rate=args.request_rate, seed=args.seed))


class BenchError(RuntimeError):
    """The server cannot be benchmarked; says which URL and what failed."""


async def replay(entries: list[TraceEntry], base_url: str, model: str | None,
                 max_concurrency: int = 0, timeout_s: float = 1800.0) -> dict:
    limits = httpx.Limits(max_connections=max(len(entries), 1) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        model = model or await _first_model(client, base_url)
        gate = asyncio.Semaphore(max_concurrency or len(entries))
        records = [RequestRecord(len(e.prompt_token_ids), e.output_len) for e in entries]
        start_s = time.monotonic()
        tasks = [asyncio.create_task(_one(client, model, entry, record, gate, start_s))
                 for entry, record in zip(entries, records)]
        await _progress(tasks)
        duration_s = time.monotonic() - start_s
    result = summarize(records, duration_s)
    result["model"] = model
    result["base_url"] = base_url
    result["requests"] = [asdict(r) | {"start_s": r.start_s - start_s,
                                       "token_times_s": [t - start_s for t in r.token_times_s],
                                       "end_s": r.end_s - start_s} for r in records]
    return result


async def _first_model(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        response = await client.get("/v1/models", timeout=10.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise BenchError(f"cannot list models at {base_url}/v1/models: {exc!r}") from exc


async def _progress(tasks: list[asyncio.Task]) -> None:
    from tqdm import tqdm

    with tqdm(total=len(tasks), desc="requests", unit="req", file=sys.stderr) as bar:
        for finished in asyncio.as_completed(tasks):
            await finished
            bar.update(1)


async def _one(client: httpx.AsyncClient, model: str, entry: TraceEntry, record: RequestRecord,
               gate: asyncio.Semaphore, start_s: float) -> None:
    await asyncio.sleep(max(0.0, start_s + entry.arrival_s - time.monotonic()))
    body = {"model": model, "prompt": entry.prompt_token_ids, "max_tokens": entry.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with gate:
        record.start_s = time.monotonic()
        try:
            await _stream(client, body, record)
        except (httpx.HTTPError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end_s = time.monotonic()


async def _stream(client: httpx.AsyncClient, body: dict, record: RequestRecord) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {text[:200]}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                record.error = str(chunk["error"])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                record.token_times_s.append(time.monotonic())
            if chunk.get("usage"):
                record.output_tokens = int(chunk["usage"]["completion_tokens"])
