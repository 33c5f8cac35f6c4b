"""The Grafana dashboard asks Prometheus only for series the fleet exports."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tokenfleet.gateway.metrics import GatewayMetrics
from tokenfleet.workers.metrics import Metrics
from tokenfleet.workers.stats import WorkerStats

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "tokenfleet.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
# Labels Prometheus adds to every scraped series (the operator's pod and service
# discovery), and a histogram bucket's bound.
TARGET_LABELS = {"pod", "instance", "job", "namespace", "service", "le"}
# What a PromQL expression names that is not a series: its functions and keywords.
PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "without", "rate", "histogram_quantile",
                "label_values"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every series name a worker's /metrics serves, with its label names."""
    stats = WorkerStats(jobs={"failed": 1})
    metrics = Metrics("q", stats)
    # One observation each, so that every labelled family shows its labels.
    metrics.queue_state({"high": {"depth": 2, "pending": 1, "lag": 1}}, backlog=9, running=1)
    metrics.ttft.labels("q").observe(0.1)
    metrics.itl.labels("q").observe(0.01)
    metrics.started(metrics.clock())
    # A gateway's, with its pool, batch driver and webhook deliverer.
    pool = SimpleNamespace(in_use=1, max_connections=4, waiting=0, waits=0, timeouts=0)
    gateway = GatewayMetrics(SimpleNamespace(
        fleet=SimpleNamespace(redis=SimpleNamespace(connection_pool=pool)),
        batch_driver=SimpleNamespace(lines_fed=1, lines_collected=1),
        webhooks=SimpleNamespace(outcomes=Counter(delivered=1))))
    gateway.requests.labels("/v1/models", "GET", "200", "acme").inc()
    gateway.duration.labels("/v1/models").observe(0.1)
    gateway.ttft.labels("/v1/chat/completions").observe(0.1)
    gateway.streams.labels("/v1/chat/completions").inc()
    series: dict[str, set[str]] = {}
    for family in [*metrics.registry.collect(), *gateway.registry.collect()]:
        labels = {label for sample in family.samples for label in sample.labels}
        for suffix in SUFFIXES[family.type]:
            series[family.name + suffix] = labels
    return series


def expressions(dashboard: dict[str, Any]) -> list[str]:
    found = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    found += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return found


def test_every_expression_names_only_exported_series_and_labels(
        dashboard: dict[str, Any], exported: dict[str, set[str]]) -> None:
    for expr in expressions(dashboard):
        # Durations and label values out first: "[5m]", '"succeeded"'.
        bare = re.sub(r'"[^"]*"|\[[^\]]*\]|\$\w+', "", expr)
        words = set(re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*", bare))
        names = {w for w in words if w.startswith("tokenfleet_")}
        assert names and names <= set(exported), (expr, names - set(exported))
        labels = set().union(*(exported[n] for n in names)) | TARGET_LABELS
        assert words - names - PROMQL_WORDS <= labels, (expr, words - names - PROMQL_WORDS)


def test_the_dashboard_shows_what_an_operator_scales_and_pages_on(
        dashboard: dict[str, Any]) -> None:
    text = "\n".join(expressions(dashboard))
    for series in ("tokenfleet_queue_depth", "tokenfleet_running_jobs",
                   "tokenfleet_backlog_tokens", "tokenfleet_time_to_first_token_seconds_bucket",
                   "tokenfleet_inter_token_latency_seconds_bucket",
                   "tokenfleet_tokens_generated_total", "tokenfleet_jobs_total",
                   "tokenfleet_store_retries_total"):
        assert series in text, series
    assert "by (queue, priority)" in text  # backlog per queue and priority
    assert text.count("histogram_quantile(0.99") >= 2  # TTFT and ITL tails


def test_the_dashboard_has_a_gateway_row_of_its_requests_latencies_and_pool(
        dashboard: dict[str, Any]) -> None:
    titles = [p["title"] for p in dashboard["panels"]]
    assert "Gateway" in titles
    text = "\n".join(expressions(dashboard))
    for series in ("tokenfleet_gateway_requests_total",
                   "tokenfleet_gateway_time_to_first_token_seconds_bucket",
                   "tokenfleet_gateway_request_duration_seconds_bucket",
                   "tokenfleet_gateway_open_streams", "tokenfleet_gateway_redis_waiting",
                   "tokenfleet_gateway_batch_lines_fed_total",
                   "tokenfleet_gateway_webhook_deliveries_total"):
        assert series in text, series
