"""Prometheus metrics of the frontend (vLLM's names under the `conveyor:` prefix), own registry,
with the frontend process's own `process_*` series (memory, CPU, open files).

Counting unit: each of a request's n choices is one engine sequence, as vLLM V1 runs each sample
as a child request; so request_success_total, the latency histograms and
request_generation_tokens count choices. The prompt is one per request: prompt_tokens_total
(counted once its first token arrives, i.e. once it was prefilled) and request_prompt_tokens
(observed when the request ends) count requests.

Clocks: TTFT, inter-token and end-to-end latencies use this process's monotonic clock only
(HTTP arrival to frame receipt); queue / prefill / decode times are differences of two scheduler
timestamps (see lifecycle.py). Scheduler running totals become counters through their increments
since the last message: a counter never goes backwards.
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
                               generate_latest)

from frontend.lifecycle import LifecycleTracker
from proto.config import EngineConfig
from proto.messages import FinishReason, StepOutputs

PREFIX = "conveyor:"
# No `*_created` gauge beside every counter and histogram: it doubles the series to store and
# no query of ours (or of vLLM's dashboards) reads it. A process-wide setting of prometheus_client.
disable_created_metrics()
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                     30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
                  2.5, 5.0, 10.0, 30.0)
# Why a request was refused before it ran: the limit (flag) or the server state that refused it.
REJECTION_REASONS = ("max_num_waiting", "max_waiting_tokens", "max_request_body_bytes", "draining",
                     "engine_unavailable", "client_timeout", "tokenizer_busy")
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)  # request_params_n; n is at most 16
OCCUPANCY_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# Scheduler running totals (SchedulerStats fields) -> our counter names.
_SCHEDULER_TOTALS = {
    "num_preemptions_total": "num_preemptions",
    "prefix_cache_queries_total": "prefix_cache_queries",
    "prefix_cache_hits_total": "prefix_cache_hits",
    "num_protocol_errors_total": "protocol_errors",
    "num_padded_slot_steps_total": "padded_slot_steps",
    "num_worker_restarts_total": "worker_restarts",
    "num_requests_recovered_total": "requests_recovered",
}


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


def power_of_two_buckets(limit: int) -> tuple[float, ...]:
    """1, 8, 16, 32, ... up to the first power of two >= `limit` (per-step token counts)."""
    buckets, size = [1.0], 8
    while size < limit * 2:
        buckets.append(float(size))
        size *= 2
    return tuple(buckets)


class FrontendMetrics:
    """All series carry `model_name`. Implements EngineListener for the scheduler's messages."""

    def __init__(self, model_name: str, max_num_seqs: int = 1, max_model_len: int = 2048,
                 max_num_batched_tokens: int = 2048) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)  # this process's process_resident_memory_bytes, CPU, fds
        self._model_name = model_name
        self._max_num_seqs = max_num_seqs
        self._seen_totals = dict.fromkeys(_SCHEDULER_TOTALS, 0)  # high-water marks
        self._lifecycle = LifecycleTracker()
        token_buckets = one_two_five_buckets(max_model_len)
        gauge, counter, histogram = self._gauge, self._counter, self._histogram
        self.num_requests_running = gauge("num_requests_running", "Sequences in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of prefilled requests.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated (all choices).")
        self.num_preemptions = counter("num_preemptions_total", "Sequences preempted by the scheduler.")
        self.prefix_cache_queries = counter("prefix_cache_queries_total",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits_total",
                                         "Prompt tokens found in the prefix cache.")
        self.protocol_errors = counter("protocol_errors_total",
                                       "Malformed frames dropped (scheduler's and frontend's).")
        self.padded_slot_steps = counter("padded_slot_steps_total",
                                         "Static scheduling: seat-steps held by finished sequences.")
        self.process_restarts = Counter(PREFIX + "process_restarts_total",
                                        "Processes replaced after a fault, by process.",
                                        ("model_name", "process"), registry=self.registry)
        self.worker_restarts = self.process_restarts.labels(model_name, "worker")
        # The supervisor counts the frontend's own restarts and hands the total to each new one.
        self.frontend_restarts = self.process_restarts.labels(model_name, "frontend")
        # Replaced schedulers this frontend recovered from (it sees each new one itself).
        self.scheduler_restarts = self.process_restarts.labels(model_name, "scheduler")
        # The scheduler counts sequences requeued after a worker group loss, this frontend those
        # it resubmits to a replacement scheduler (which does not count them again).
        self.requests_recovered = counter("requests_recovered_total",
                                          "Sequences continued (tokens kept) after a fault: running ones "
                                          "requeued when their worker group was replaced, and open ones "
                                          "resubmitted to a replacement scheduler.")
        self.request_success = Counter(PREFIX + "request_success_total", "Finished choices by reason.",
                                       ("model_name", "finished_reason"), registry=self.registry)
        for reason in filter(None, FinishReason):  # every series exists from the start
            self.request_success.labels(model_name, reason)
        self.request_rejected = Counter(PREFIX + "request_rejected_total",
                                        "Requests refused before they ran (429, 413, 408, 503), by reason.",
                                        ("model_name", "reason"), registry=self.registry)
        for reason in REJECTION_REASONS:
            self.request_rejected.labels(model_name, reason)
        resident = Gauge(PREFIX + "process_resident_memory_bytes",
                         "Resident memory of the scheduler and of its node's worker ranks (summed), by "
                         "process; the frontend's own is process_resident_memory_bytes.",
                         ("model_name", "process"), registry=self.registry)
        self.scheduler_rss = resident.labels(model_name, "scheduler")
        self.workers_rss = resident.labels(model_name, "workers")
        self.http_requests = Counter(PREFIX + "http_requests_total", "HTTP answers by route, method and status.",
                                     ("model_name", "handler", "method", "status"), registry=self.registry)
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Request arrival to a choice's first token.", TTFT_BUCKETS_S)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Between two token deliveries of one choice.", ITL_BUCKETS_S)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Request arrival to a choice's end.", REQUEST_BUCKETS_S)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "A choice's mean time per output token after its first (choices of 2 tokens or more).", ITL_BUCKETS_S)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Queued to first scheduled (scheduler clock).", REQUEST_BUCKETS_S)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "First scheduled to first token (scheduler clock).",
                                              REQUEST_BUCKETS_S)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "First token to finished (scheduler clock).", REQUEST_BUCKETS_S)
        self.request_inference_time = histogram("request_inference_time_seconds",
                                                "First scheduled to finished (scheduler clock).",
                                                REQUEST_BUCKETS_S)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per choice.", token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Generated tokens of a request's longest choice.",
            token_buckets)
        self.request_params_n = histogram("request_params_n", "The n of each finished request.", N_BUCKETS)
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "The max_tokens of each finished request (as resolved).",
                                                   token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per step.",
                                          power_of_two_buckets(max_num_batched_tokens))
        self.step_duration = histogram("step_duration_seconds", "Scheduler step duration.", STEP_BUCKETS_S)
        self.batch_occupancy = histogram("batch_occupancy", "Running seats / max_num_seqs, per step.",
                                         OCCUPANCY_BUCKETS)

    # -- per request, from the HTTP side (our monotonic clock) --------------------------------

    def record_prompt(self, num_prompt_tokens: int) -> None:
        """The request's first token arrived: its prompt was prefilled."""
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_choice_tokens(self, num_tokens: int, latency_s: float, first: bool) -> None:
        """`latency_s`: since arrival for a choice's first tokens, else since its previous ones."""
        self.generation_tokens.inc(num_tokens)
        (self.time_to_first_token if first else self.inter_token_latency).observe(latency_s)

    def record_choice_finished(self, finish_reason: FinishReason, e2e_s: float, num_tokens: int,
                               decode_s: float | None = None) -> None:
        """decode_s: from the choice's first token to its last (None: it got no token); an abort's
        wait after its last token is not time per token."""
        self.request_success.labels(self._model_name, finish_reason).inc()
        self.e2e_request_latency.observe(e2e_s)
        self.request_generation_tokens.observe(num_tokens)
        if decode_s is not None and num_tokens >= 2:
            self.request_time_per_output_token.observe(decode_s / (num_tokens - 1))

    def record_request_finished(self, num_prompt_tokens: int, n: int = 1, max_tokens: int = 0,
                                max_num_generation_tokens: int = 0) -> None:
        """One per request (all its choices): `max_tokens` as resolved (0: none asked, as for an
        echo that only scores the prompt: not observed),
        `max_num_generation_tokens` the longest choice's count."""
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_params_n.observe(n)
        if max_tokens:
            self.request_params_max_tokens.observe(max_tokens)
        self.request_max_num_generation_tokens.observe(max_num_generation_tokens)

    def record_cache_config(self, config: EngineConfig) -> None:
        """vLLM's cache_config_info: a gauge of 1 whose labels are the KV cache's settings, so that
        instances can be compared in Prometheus. Set once, at start-up."""
        labels = {"block_size": str(config.block_size), "cache_dtype": config.kv_dtype,
                  "enable_prefix_caching": str(config.enable_prefix_caching),
                  "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes),
                  "gpu_memory_utilization": str(config.gpu_memory_utilization),
                  "num_kv_blocks": str(config.num_kv_blocks or "auto")}
        Gauge(PREFIX + "cache_config_info", "The KV cache's configuration (labels); always 1.",
              ("model_name", *labels), registry=self.registry).labels(self._model_name, *labels.values()).set(1)

    def record_http(self, handler: str, method: str, status: int) -> None:
        """`handler`: the route's path template (or "other"), so the series stay few."""
        self.http_requests.labels(self._model_name, handler, method, str(status)).inc()

    def record_rejection(self, reason: str) -> None:
        """`reason`: one of REJECTION_REASONS."""
        self.request_rejected.labels(self._model_name, reason).inc()

    # -- EngineListener: the scheduler's messages ---------------------------------------------

    def on_step_outputs(self, outputs: StepOutputs) -> None:
        stats = outputs.stats
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        if stats.scheduler_rss_bytes:  # 0: unknown (no procfs), or a message from before the first sample
            self.scheduler_rss.set(stats.scheduler_rss_bytes)
        if stats.workers_rss_bytes:
            self.workers_rss.set(stats.workers_rss_bytes)
        for field_name, attribute in _SCHEDULER_TOTALS.items():
            total = getattr(stats, field_name)
            # A lower total is a message that does not carry it: never count backwards.
            if total > self._seen_totals[field_name]:
                getattr(self, attribute).inc(total - self._seen_totals[field_name])
                self._seen_totals[field_name] = total
        if outputs.step_id >= 0:  # heartbeats are no steps
            self.iteration_tokens.observe(outputs.num_scheduled_tokens)
            self.step_duration.observe(outputs.step_duration_s)
            self.batch_occupancy.observe(stats.num_running / self._max_num_seqs)
        for phases in self._lifecycle.observe(outputs):
            for histogram, seconds in ((self.request_queue_time, phases.queue_s),
                                       (self.request_prefill_time, phases.prefill_s),
                                       (self.request_decode_time, phases.decode_s),
                                       (self.request_inference_time, phases.inference_s)):
                if seconds is not None:
                    histogram.observe(seconds)

    def on_protocol_error(self) -> None:
        self.protocol_errors.inc()

    def continue_restart_counts(self, num_restarts: dict[str, int]) -> None:
        """A restarted frontend takes on the supervisor's restart counts by process kind, so that
        process_restarts_total never drops. Its worker count is of the groups replaced under earlier
        schedulers: the running scheduler reports its own in full (a group replaced while this
        frontend starts is in that report, and counted once)."""
        for kind, count in num_restarts.items():
            self.process_restarts.labels(self._model_name, kind).inc(count)

    def on_scheduler_replaced(self, num_sequences_resubmitted: int) -> None:
        """A new scheduler continues `num_sequences_resubmitted` open choices (recovered), and its
        running totals start from zero: count on from there (the lost one's late frames are
        dropped before they reach us, so nothing counts twice)."""
        self.scheduler_restarts.inc()
        self.requests_recovered.inc(num_sequences_resubmitted)
        self._seen_totals = dict.fromkeys(self._seen_totals, 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ("model_name",), registry=self.registry).labels(self._model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, ("model_name",), registry=self.registry).labels(self._model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, ("model_name",), buckets=buckets,
                         registry=self.registry).labels(self._model_name)
