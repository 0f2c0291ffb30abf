"""Prometheus metrics of the frontend (vLLM's names under the `conveyor:` prefix), own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from frontend.engine_client import EngineStats

PREFIX = "conveyor:"
TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                  10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0)


class FrontendMetrics:
    """All series carry `model_name`. Latencies are measured on this process's monotonic clock
    only; scheduler stats are copied from its latest message at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name",)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Seconds from request arrival to its first token.", TTFT_BUCKETS_S)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Seconds from request arrival to its end.", E2E_BUCKETS_S)

    def record_first_token(self, num_prompt_tokens: int, seconds: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.time_to_first_token.observe(seconds)

    def record_tokens(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def record_finished(self, seconds: float) -> None:
        self.e2e_request_latency.observe(seconds)

    def render(self, stats: EngineStats | None) -> bytes:
        """The exposition text, with the scheduler gauges set from `stats` (None: not heard yet)."""
        if stats is not None:
            self.num_requests_running.set(stats.num_running)
            self.num_requests_waiting.set(stats.num_waiting)
            self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        return generate_latest(self.registry)
