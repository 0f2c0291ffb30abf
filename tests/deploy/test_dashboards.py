"""deploy: the Grafana dashboard queries only metrics a running conveyor exports, and Prometheus
scrapes it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from support import tiny_config

from deploy.launcher import Stack

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "conveyor.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"

# What the issue asks the dashboard to show, as the series that show it.
REQUIRED_SERIES = ("generation_tokens_total", "request_success_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                   "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "num_preemptions_total", "step_duration_seconds_bucket", "prefix_cache_hits_total")
_METRIC = re.compile(r"conveyor:[A-Za-z0-9_:]+")


@pytest.fixture(scope="module")
def exported_series(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every series name a real conveyor's /metrics shows (histograms as _bucket/_sum/_count)."""
    from prometheus_client.parser import text_string_to_metric_families

    with Stack(tiny_config(tiny_model_dir), log_dir=tmp_path_factory.mktemp("logs")) as stack:
        httpx.get(f"{stack.url}/health", timeout=10)  # an answer, so that the HTTP answer count has a series
        text = httpx.get(f"{stack.url}/metrics", timeout=10).text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def _queries(node: object) -> Iterator[str]:
    """PromQL strings of the dashboard: panel target `expr`s and templating queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str) and "conveyor:" in value:
                yield value
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def dashboard_queries() -> list[str]:
    return list(_queries(json.loads(DASHBOARD.read_text())))


def queried_series() -> set[str]:
    return {name for query in dashboard_queries() for name in _METRIC.findall(query)}


def test_every_metric_the_dashboard_queries_is_exported_by_a_running_conveyor(exported_series: set[str]) -> None:
    queried = queried_series()
    assert len(queried) > 20
    unknown = queried - exported_series
    assert not unknown, f"the dashboard queries series conveyor does not export: {sorted(unknown)}"


def test_the_dashboard_shows_throughput_latency_batch_kv_preemptions_step_time_and_cache_hits() -> None:
    missing = {f"conveyor:{name}" for name in REQUIRED_SERIES} - queried_series()
    assert not missing, f"the dashboard does not show {sorted(missing)}"


def test_latency_percentiles_are_p50_p90_p99_over_histogram_buckets() -> None:
    quantile_queries = [q for q in dashboard_queries() if q.startswith("histogram_quantile(")]
    for query in quantile_queries:
        assert "_bucket{" in query and "by (le)" in query, query
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        levels = {re.match(r"histogram_quantile\(([0-9.]+)", q).group(1)
                  for q in quantile_queries if f"conveyor:{histogram}_bucket" in q}
        assert levels == {"0.5", "0.9", "0.99"}, (histogram, levels)


def test_every_panel_reads_the_selected_data_source_and_model() -> None:
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'model_name=~"$model_name"' in target["expr"], (panel["title"], target["expr"])


def test_prometheus_scrapes_conveyor_metrics_on_the_default_port() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "conveyor"]
    assert job["metrics_path"] == "/metrics"
    assert "127.0.0.1:8000" in job["static_configs"][0]["targets"]
