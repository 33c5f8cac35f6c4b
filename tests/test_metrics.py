"""A worker's Prometheus metrics: its counters are its ``WorkerStats`` (one count,
shown by ``/metrics`` and ``tokenfleet status`` alike). Its HTTP server:
tests/test_health.py."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet.workers.metrics import Metrics
from tokenfleet.workers.stats import WorkerStats

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

JOBS = {"succeeded": 5, "failed": 1, "cancelled": 2}


def samples(registry: CollectorRegistry, prefix: tuple[str, ...]) -> Samples:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith(prefix)}


def counted_by_prometheus_client() -> Samples:
    """The same counts kept with prometheus_client's own counters."""
    r = CollectorRegistry()
    jobs = Counter("tokenfleet_jobs_total", "doc", ["queue", "status"], registry=r)
    for status, n in JOBS.items():
        jobs.labels("q", status).inc(n)
    Counter("tokenfleet_tokens_generated_total", "doc", ["queue"], registry=r).labels("q").inc(41)
    Counter("tokenfleet_failed_steps_total", "doc", registry=r).inc(2)
    Counter("tokenfleet_store_retries_total", "doc", registry=r).inc(3)
    return samples(r, COUNTERS)


COUNTERS = ("tokenfleet_jobs", "tokenfleet_tokens_generated", "tokenfleet_failed_steps",
            "tokenfleet_store_retries")


def test_the_counters_are_the_worker_stats_as_prometheus_client_shows_them() -> None:
    stats = WorkerStats(tokens=41, jobs=dict(JOBS), failed_steps=2, store_retries=3)
    metrics = Metrics("q", stats)
    mine, theirs = samples(metrics.registry, COUNTERS), counted_by_prometheus_client()
    assert mine.keys() == theirs.keys()  # the same samples, _total and _created alike
    for key, value in theirs.items():
        if key[0].endswith("_created"):
            assert mine[key] == stats.started_at, key
        else:
            assert mine[key] == value, key
    stats.tokens += 9  # read at each scrape: nothing to keep in step
    scraped = samples(metrics.registry, COUNTERS)
    assert scraped[("tokenfleet_tokens_generated_total", (("queue", "q"),))] == 50


def test_queue_depth_counts_waiting_jobs_and_running_ones_are_counted_apart() -> None:
    metrics = Metrics("q", WorkerStats())
    # 50 jobs taken by workers (pending), none waiting: the stream holds 50 entries.
    metrics.queue_state({"normal": {"depth": 50, "pending": 50, "lag": 0},
                         "high": {"depth": 7, "pending": 3, "lag": 4}}, backlog=0, running=50)
    got = samples(metrics.registry, ("tokenfleet_queue_depth", "tokenfleet_running_jobs"))
    assert got[("tokenfleet_queue_depth", (("priority", "normal"), ("queue", "q")))] == 0
    assert got[("tokenfleet_running_jobs", (("priority", "normal"), ("queue", "q")))] == 50
    assert got[("tokenfleet_queue_depth", (("priority", "high"), ("queue", "q")))] == 4
    assert got[("tokenfleet_running_jobs", (("priority", "high"), ("queue", "q")))] == 3


def test_a_workers_rate_is_over_the_last_ten_seconds_and_reads_0_once_idle_that_long(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenfleet.workers import stats as stats_module

    now = [1000.0]
    monkeypatch.setattr(stats_module.time, "monotonic", lambda: now[0])
    stats = WorkerStats()
    for second in range(5):  # 5 s of 100 tokens a second, then nothing
        now[0] = 1000.0 + second
        stats._recent.append((now[0], 100))
    now[0] = 1005.0
    assert stats.tokens_per_s() == pytest.approx(50.0)  # 500 tokens over the last 10 s
    assert stats.as_dict()["rate_window_s"] == 10.0
    now[0] = 1014.5  # the burst's last step was 10.5 s ago: an idle worker
    assert stats.tokens_per_s() == 0.0
