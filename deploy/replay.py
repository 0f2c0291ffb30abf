"""Replay a trace against any OpenAI-compatible server with streaming, timing every token.

Each request sends its prompt as token ids to the completions endpoint with `max_tokens` = the
trace's output length, `ignore_eos` and temperature 0, so every server does the same work. With
--json-schema, a --constrained-fraction of the requests (spread evenly over the trace) also ask for
output that follows the schema (`response_format` json_schema); a constrained output ends when its
document is complete, so it may be shorter than asked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from deploy.bench_report import summarize
from proto.trace import TraceEntry

COMPLETIONS_ENDPOINT = "/v1/completions"


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


@dataclass(frozen=True)
class ReplayOptions:
    max_concurrency: int = 0  # 0 = unlimited
    timeout_s: float = 1800.0  # per request
    endpoint: str = COMPLETIONS_ENDPOINT
    show_progress: bool = True
    json_schema: dict | None = None  # response_format json_schema for the constrained requests
    constrained_fraction: float = 0.0  # of the requests, spread evenly; only with json_schema

    def validate(self) -> None:
        if self.max_concurrency < 0:
            raise ValueError(f"--max-concurrency must be >= 0 (0 = unlimited), got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if not self.endpoint.startswith("/"):
            raise ValueError(f"--endpoint must be a path starting with '/', got {self.endpoint!r}")
        if not 0.0 <= self.constrained_fraction <= 1.0:
            raise ValueError(f"--constrained-fraction must be in [0, 1], got {self.constrained_fraction}")

    def is_constrained(self, index: int) -> bool:
        """Whether request `index` of the trace asks for the schema: every 1/fraction-th one."""
        fraction = self.constrained_fraction if self.json_schema is not None else 0.0
        return int((index + 1) * fraction) > int(index * fraction)


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """The client-side flags of a replay, shared by `conveyor bench` and `bench sweep`."""
    parser.add_argument("--max-concurrency", type=int, default=0, help="0 = unlimited")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout, s")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--json-schema", default=None, metavar="FILE",
                        help="a JSON schema that --constrained-fraction of the requests ask their output to follow")
    parser.add_argument("--constrained-fraction", type=float, default=1.0,
                        help="with --json-schema: the share of requests that are constrained (default 1)")


def replay_options(args: argparse.Namespace, endpoint: str = COMPLETIONS_ENDPOINT) -> ReplayOptions:
    """The options the flags describe; ValueError names a flag that is out of range."""
    schema = None
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as file:
            schema = json.load(file)  # OSError / ValueError name the file
    options = ReplayOptions(args.max_concurrency, args.timeout, endpoint, show_progress=not args.disable_tqdm,
                            json_schema=schema, constrained_fraction=args.constrained_fraction)
    options.validate()
    return options


class BenchError(RuntimeError):
    """The server cannot be benchmarked; says which URL and what failed."""


async def replay(entries: list[TraceEntry], base_url: str, model: str | None,
                 options: ReplayOptions = ReplayOptions()) -> dict:
    """Send every entry at its arrival time; the summary (bench_report.summarize) plus the
    per-request records, with times relative to the start of the run."""
    limits = httpx.Limits(max_connections=max(len(entries), 1) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=options.timeout_s, limits=limits) as client:
        model = model or await _first_model(client, base_url)
        gate = asyncio.Semaphore(options.max_concurrency or len(entries))
        records = [RequestRecord(len(e.prompt_token_ids), e.output_len) for e in entries]
        start_s = time.monotonic()
        tasks = [asyncio.create_task(_one(client, model, entry, record, gate, start_s, options.endpoint,
                                          options.json_schema if options.is_constrained(index) else None))
                 for index, (entry, record) in enumerate(zip(entries, records))]
        try:
            await _progress(tasks, options.show_progress)
        finally:  # interrupted (Ctrl-C): no request may outlive the client it streams through
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration_s = time.monotonic() - start_s
    result = summarize(records, duration_s)
    result["model"] = model
    result["base_url"] = base_url
    result["endpoint"] = options.endpoint
    result["num_constrained"] = sum(options.is_constrained(index) for index in range(len(entries)))
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


async def _progress(tasks: list[asyncio.Task], show: bool) -> None:
    from tqdm import tqdm

    with tqdm(total=len(tasks), desc="requests", unit="req", file=sys.stderr, disable=not show) as bar:
        for finished in asyncio.as_completed(tasks):
            await finished
            bar.update(1)


async def _one(client: httpx.AsyncClient, model: str, entry: TraceEntry, record: RequestRecord,
               gate: asyncio.Semaphore, start_s: float, endpoint: str, json_schema: dict | None) -> None:
    await asyncio.sleep(max(0.0, start_s + entry.arrival_s - time.monotonic()))
    body = {"model": model, "prompt": entry.prompt_token_ids, "max_tokens": entry.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": json_schema}}
    async with gate:
        record.start_s = time.monotonic()
        try:
            await _stream(client, endpoint, body, record)
        except (httpx.HTTPError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end_s = time.monotonic()


async def _stream(client: httpx.AsyncClient, endpoint: str, body: dict, record: RequestRecord) -> None:
    async with client.stream("POST", endpoint, json=body) as response:
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
