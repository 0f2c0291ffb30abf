"""Helpers for tests that run the real stack: configs, HF references, SSE and metrics parsing."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from deploy.model_info import read_model_info
from proto.config import EngineConfig

if TYPE_CHECKING:
    import torch

    from deploy.launcher import Stack


def children_of(pid: int) -> list[int]:
    """The pids whose parent is pid, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().split(") ")[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_block(size: int) -> int:
    """A base port with `size` free ports after it (torch.distributed + the step channels)."""
    for _ in range(50):
        base = free_port()
        if base + size > 65535:
            continue
        try:
            for port in range(base, base + size):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no block of {size} free ports")


def hides_gpus(ranks: int | None, cpu_workers: bool, gpus: list[str]) -> bool:
    """Whether a test marked cpu_workers, or ranks(n) (None: unmarked), runs its workers on the CPU."""
    return cpu_workers or (ranks is not None and len(gpus) < ranks)


def tiny_config(model_dir: Path, **overrides: object) -> EngineConfig:
    info = read_model_info(model_dir)
    base = dict(model=str(model_dir), served_model_name="tiny", dtype="float32",
                num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256,
                max_model_len=info.max_position_embeddings, vocab_size=info.vocab_size,
                eos_token_ids=info.eos_token_ids, port=free_port(), num_threads=1,
                ready_timeout_s=120.0, shutdown_timeout_s=5.0, log_level="warning")
    base.update(overrides)
    return EngineConfig(**base)


def hf_greedy_texts(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Hugging Face `generate` (fp32, greedy) continuations, decoded: the correctness anchor."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            texts.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


def hf_greedy_logprobs(model_dir: Path, prompt_ids: list[int],
                       num_new: int) -> tuple[list[int], torch.Tensor]:
    """greedy_logprobs of the HF checkpoint in `model_dir`, in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return greedy_logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
                           prompt_ids, num_new)


def greedy_logprobs(model: torch.nn.Module, prompt_ids: list[int],
                    num_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy token ids an HF model generates after `prompt_ids` (EOS does not stop them) and
    float32 [num_prompt + num_new - 1, vocab] log_softmax of its logits (row t predicts token t + 1)."""
    import torch

    ids = list(prompt_ids)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from more; on busy cores they spin
    try:
        with torch.inference_mode():
            for _ in range(num_new):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
            logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), dim=-1)
    finally:
        torch.set_num_threads(num_threads)
    return ids[len(prompt_ids):], logprobs


def sse_events(lines: list[str]) -> list[dict | str]:
    """Parsed `data:` payloads of an SSE body; the literal '[DONE]' stays a string."""
    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metric_value(base_url: str, name: str, **labels: str) -> float:
    """The summed value of one sample of /metrics (all label sets matching `labels`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    if not found:
        raise KeyError(f"{name}{labels} not in /metrics")
    return total


@contextmanager
def supervised(stack: Stack) -> Iterator[list[str]]:
    """The supervisor's watch (what `conveyor serve` runs) in a thread, so that lost workers are
    replaced; yields a list that gets why the watch returned."""
    stop, reasons = threading.Event(), []
    thread = threading.Thread(target=lambda: reasons.append(stack.watch(stop.is_set, poll_s=0.2)),
                              daemon=True)
    thread.start()
    try:
        yield reasons
    finally:
        stop.set()
        thread.join(timeout=30)


@contextmanager
def caplog_of(logger_name: str) -> Iterator[list[str]]:
    """Messages logged to logger_name (and below) while the block runs."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler, logger = Collect(), logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def recovery_workload(label: str, seed_base: int, num_requests: int = 8) -> tuple[list[str], list[dict]]:
    """Prompts and params for the recovery tests: greedy and seeded-sampled requests alternate, so
    both must come out exactly as an undisturbed run's."""
    prompts = [f"{label} {i}: the quick brown fox" + " jumps over" * (i % 3) for i in range(num_requests)]
    params = [{"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.9, "seed": seed_base + i}
              for i in range(num_requests)]
    return prompts, params


def stream_burst(url: str, prompts: list[str], params: list[dict], max_tokens: int,
                 timeout_s: float = 180.0) -> list[tuple[str, str]]:
    """Stream every completion at once; each one's (text, finish_reason), after checking that its
    stream ended with [DONE]."""
    async def one(client: httpx.AsyncClient, prompt: str, fields: dict) -> tuple[str, str]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, **fields}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = sse_events([line async for line in response.aiter_lines()])
        assert events[-1] == "[DONE]"
        chunks = [event for event in events[:-1] if event["choices"]]
        return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]

    async def burst() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
            return await asyncio.gather(*(one(client, p, q) for p, q in zip(prompts, params)))
    return asyncio.run(burst())


class HealthWatch(threading.Thread):
    """Polls /health every period_s; keeps (time.time(), status code) pairs (0: no answer)."""

    def __init__(self, url: str, period_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.url, self.period_s, self.samples, self.stop = url, period_s, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set():
                try:
                    code = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError:
                    code = 0
                self.samples.append((time.time(), code))
                time.sleep(self.period_s)

    def finish(self, after_s: float = 0.0) -> None:
        """Keep polling after_s more seconds, then stop."""
        time.sleep(after_s)
        self.stop.set()
        self.join()


def timed_stream(url: str, prompt: str, max_tokens: int) -> list[float]:
    """Stream one greedy completion; the time.time() at which each token chunk arrived, after
    checking that it ended with finish_reason "length" and [DONE]."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    arrivals, lines = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith("data: {") and any(c["text"] for c in json.loads(line[6:])["choices"]):
                arrivals.append(time.time())
    events = sse_events(lines)
    chunks = [event for event in events[:-1] if event["choices"]]
    assert events[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    return arrivals


def watched_stream(url: str, prompt: str, max_tokens: int) -> tuple[list[float], list[tuple[float, int]]]:
    """timed_stream with /health polled every 50 ms meanwhile and 1.2 s after: (the token
    arrivals, the HealthWatch samples)."""
    health = HealthWatch(url, period_s=0.05)
    health.start()
    try:
        arrivals = timed_stream(url, prompt, max_tokens)
    finally:
        health.finish(after_s=1.2)
    return arrivals, health.samples


def assert_health_follows_recovery(samples: list[tuple[float, int]], fault_s: float, arrivals: list[float],
                                   within_s: float = 1.0) -> None:
    """/health turned 503 within within_s of the fault at fault_s, stayed 503, and was 200 again
    within a second of serving again: of the first token after the stream's longest pause."""
    pause = max(range(1, len(arrivals)), key=lambda i: arrivals[i] - arrivals[i - 1])
    resumed_s = arrivals[pause]
    # The tiny model's tokens come milliseconds apart; replacing its worker group can take under a
    # second (two CI runs saw 0.96-0.98 s), so the fault's pause is told apart at half a second.
    assert resumed_s - arrivals[pause - 1] > 0.5, f"no pause in the stream: {arrivals}"
    unhealthy = next((t for t, code in samples if t > fault_s and code == 503), None)
    assert unhealthy is not None and unhealthy - fault_s < within_s, \
        f"/health turned 503 {None if unhealthy is None else unhealthy - fault_s} s after the fault: {samples}"
    healthy = next((t for t, code in samples if t > unhealthy and code == 200), None)
    assert healthy is not None and abs(healthy - resumed_s) < 1.0, \
        f"/health turned 200 {None if healthy is None else healthy - resumed_s} s after serving again"
