"""A flood through the real stack (loopback, bounded): admitted requests complete, the rest get a
429 with Retry-After at once, /health and /metrics keep answering, every process stays small."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from support import metric_value, tiny_config

from deploy.launcher import Stack

NUM_REQUESTS = 80  # one every ARRIVAL_GAP_S against 2 seats + 8 waiting: well over what it sustains
ARRIVAL_GAP_S = 0.01
MAX_TOKENS = 32  # long enough that 2 seats drain far slower than the flood arrives
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # about 40 tiny-model tokens
MAX_WAITING_TOKENS = 200  # about four waiting prompts: the token bound binds before the count
# Resident memory after the flood. Measured on the tiny model on 2 cores: frontend 74 MiB,
# scheduler 40 MiB, worker 257 MiB (torch); the bounds leave room and catch a leak of the flood.
MAX_RSS_BYTES = {"frontend": 300 << 20, "scheduler": 150 << 20, "worker": 800 << 20}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


async def one_request(http: httpx.AsyncClient, index: int) -> tuple[int, dict, str, float]:
    """(status, headers, body, seconds): even indices stream, odd ones do not."""
    await asyncio.sleep(index * ARRIVAL_GAP_S)
    body = {"model": "tiny", "prompt": f"{index} {PROMPT}", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": index % 2 == 0}
    started_s = time.monotonic()
    response = await http.post("/v1/completions", json=body)
    return response.status_code, dict(response.headers), response.text, time.monotonic() - started_s


async def probe(http: httpx.AsyncClient, path: str, stop: asyncio.Event) -> float:
    """The slowest answer of `path` while the flood lasts."""
    worst_s = 0.0
    while not stop.is_set():
        started_s = time.monotonic()
        assert (await http.get(path)).status_code == 200
        worst_s = max(worst_s, time.monotonic() - started_s)
        await asyncio.sleep(0.05)
    return worst_s


async def flood(url: str) -> tuple[list[tuple[int, dict, str, float]], float, float]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 4)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        stop = asyncio.Event()
        probes = [asyncio.create_task(probe(http, path, stop)) for path in ("/health", "/metrics")]
        results = await asyncio.gather(*(one_request(http, i) for i in range(NUM_REQUESTS)))
        stop.set()
        worst_health_s, worst_metrics_s = await asyncio.gather(*probes)
    return results, worst_health_s, worst_metrics_s


@pytest.fixture(scope="module")
def small_queue_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    config = tiny_config(tiny_model_dir, max_num_seqs=2, max_num_waiting=8,
                         max_waiting_tokens=MAX_WAITING_TOKENS)
    with Stack(config, log_dir=tmp_path_factory.mktemp("logs")) as stack:
        yield stack


def test_a_flood_is_split_into_completed_requests_and_fast_429s(small_queue_stack: Stack) -> None:
    url = small_queue_stack.url
    results, worst_health_s, worst_metrics_s = asyncio.run(flood(url))
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(served) + len(refused) == NUM_REQUESTS, sorted({r[0] for r in results})
    assert len(served) >= 4 and len(refused) >= NUM_REQUESTS // 4, (len(served), len(refused))
    for status, headers, text, seconds in refused:
        assert headers["retry-after"] == "1" and '"type":"rate_limit_error"' in text, text
    assert max(r[3] for r in refused) < 2.0  # refusals never wait behind the admitted work
    for status, headers, text, seconds in served:  # every admitted request ran to its end
        if headers["content-type"].startswith("text/event-stream"):
            assert text.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in text, text
        else:
            assert '"finish_reason":"length"' in text and f'"completion_tokens":{MAX_TOKENS}' in text, text
    # Probes never queue behind the flood (that would take the flood's whole length, many seconds);
    # 2 s leaves room for a machine whose two cores are busy with other work too.
    assert worst_health_s < 2.0 and worst_metrics_s < 2.0, (worst_health_s, worst_metrics_s)
    by_reason = {reason: metric_value(url, "conveyor:request_rejected_total", reason=reason)
                 for reason in ("max_num_waiting", "max_waiting_tokens")}
    assert sum(by_reason.values()) == len(refused) and by_reason["max_waiting_tokens"] > 0, by_reason
    for child in small_queue_stack.children:
        kind = child.name.split("-")[0].rstrip("0123456789")
        assert rss_bytes(child.process.pid) < MAX_RSS_BYTES[kind], (child.name, rss_bytes(child.process.pid))
    after = httpx.post(f"{url}/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "still there?", "max_tokens": 2})
    assert after.status_code == 200, after.text
