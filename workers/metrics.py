"""Prometheus metrics of one worker process (``--metrics-port``).

Names follow Prometheus conventions: counters end in ``_total``, durations are
``_seconds`` histograms. The counters (tokens, jobs by final status, failed
steps, store retries) are the worker's ``WorkerStats``, read at each scrape:
what ``/metrics`` and ``tokenfleet status`` show is one count. Queue gauges
(jobs waiting, jobs running, lag, pending, backlog) describe the whole queue as this worker sees it,
so every worker of a queue reports the same value: aggregate them with
``max``. ``tokenfleet_backlog_tokens`` (queued prompt tokens, estimated, plus
requested ``max_new_tokens``) is a better autoscaling signal than an entry
count: it weighs long jobs as long.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tokenfleet.workers.sequence import SeqOutput
from tokenfleet.workers.stats import WorkerStats
from tokenfleet.workers.step_histogram import StepHistogram

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """The metrics of one worker: ``stats`` is the source of its counters.
    ``tokenfleet.workers.health.StatusServer`` serves them."""

    def __init__(self, queue: str, stats: WorkerStats,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry or CollectorRegistry()
        # The clock a job's created_at (its client's) is on: Redis's, in a worker.
        self.clock = clock
        r = self.registry
        self.queue = queue
        self.stats = stats
        r.register(StatsCounters(queue, stats))
        self.batch_size = Histogram("tokenfleet_batch_size", "Sequences in one engine step",
                                    buckets=BATCH, registry=r)
        self.step = Histogram("tokenfleet_step_seconds", "Time of one engine step "
                              "(forward pass and sampling)", buckets=LATENCY, registry=r)
        self.ttft = Histogram("tokenfleet_time_to_first_token_seconds",
                              "From submit to the first token", ["queue"], buckets=LATENCY,
                              registry=r)
        self.itl = StepHistogram("tokenfleet_inter_token_latency_seconds",
                                 "Between two tokens of one job", "queue", LATENCY, r)
        self.queue_wait = Histogram("tokenfleet_queue_wait_seconds",
                                    "From submit to the job's start on a worker", ["queue"],
                                    buckets=LATENCY, registry=r)
        self.depth = Gauge("tokenfleet_queue_depth", "Jobs waiting in the queue for a worker "
                           "to take them (running ones are tokenfleet_running_jobs)",
                           ["queue", "priority"], registry=r)
        self.running_jobs = Gauge("tokenfleet_running_jobs", "Jobs of the queue that workers "
                                  "have taken and not yet ended (running, or held for a free "
                                  "slot)", ["queue", "priority"], registry=r)
        self.lag = Gauge("tokenfleet_consumer_group_lag", "Entries no worker has read yet",
                         ["queue", "priority"], registry=r)
        self.pending = Gauge("tokenfleet_pending_entries", "Entries read but not acknowledged",
                             ["queue", "priority"], registry=r)
        self.tenant_queued = Gauge("tokenfleet_tenant_queued_jobs", "Jobs of a tenant waiting "
                                   "in the queue for a worker to take them", ["queue", "tenant"],
                                   registry=r)
        self.tenant_running = Gauge("tokenfleet_tenant_running_jobs", "Jobs of a tenant that "
                                    "workers have taken and not yet ended", ["queue", "tenant"],
                                    registry=r)
        self.backlog = Gauge("tokenfleet_backlog_tokens", "Queued work in tokens (prompt "
                             "estimate plus max_new_tokens)", ["queue"], registry=r)
        self.running = Gauge("tokenfleet_running_sequences", "Sequences in the running batch",
                             registry=r)
        # This queue's children, looked up once: the engine observes every token.
        self._ttft, self._itl = self.ttft.labels(queue), self.itl.labels(queue)

    def started(self, created_at: float | None) -> None:
        if created_at is not None:
            self.queue_wait.labels(self.queue).observe(max(0.0, self.clock() - created_at))

    def step_done(self, outputs: list[SeqOutput]) -> None:
        """The engine step ``stats`` recorded last made ``outputs``: its batch
        and time, and the latencies of its tokens."""
        if self.stats.last_batch:
            self.batch_size.observe(self.stats.last_batch)
            self.step.observe(self.stats.last_step_s)
        now = time.monotonic()
        # Sequences whose last token came in the same step share their latency:
        # counted by that step's time, observed once per distinct value.
        last_at: dict[float, int] = {}
        for o in outputs:
            seq = o.seq
            if o.token_id is not None:
                if seq.last_token_at is None:
                    if seq.created_at is not None:
                        self._ttft.observe(max(0.0, self.clock() - seq.created_at))
                else:
                    last_at[seq.last_token_at] = last_at.get(seq.last_token_at, 0) + 1
                seq.last_token_at = now
        for at, n in last_at.items():
            self._itl.observe(now - at, n)

    def queue_state(self, levels: dict[str, dict[str, Any]], backlog: int, running: int,
                    tenants: dict[str, dict[str, int]] | None = None) -> None:
        """``levels``: each priority level's stream length (``depth``: an entry
        stays until its job ends), pending entries and group lag; ``tenants``:
        each tenant's depth and pending entries, all levels together."""
        for tenant, info in (tenants or {}).items():
            self.tenant_queued.labels(self.queue, tenant).set(max(0, info["depth"] - info["pending"]))
            self.tenant_running.labels(self.queue, tenant).set(info["pending"])
        for priority, info in levels.items():
            # A taken entry stays pending until its job ends: what is not pending waits.
            self.depth.labels(self.queue, priority).set(max(0, info["depth"] - info["pending"]))
            self.running_jobs.labels(self.queue, priority).set(info["pending"])
            self.lag.labels(self.queue, priority).set(info["lag"])
            self.pending.labels(self.queue, priority).set(info["pending"])
        self.backlog.labels(self.queue).set(backlog)
        self.running.set(running)


class StatsCounters(Collector):
    """The counters of a ``WorkerStats``, read when scraped (each counter's
    ``_created`` is when the stats began)."""

    def __init__(self, queue: str, stats: WorkerStats) -> None:
        self._queue, self._stats = queue, stats

    def describe(self) -> list[CounterMetricFamily]:
        return list(self._families({}, 0, 0, 0, 0))

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self._stats
        # dict() copies in one call, atomic under the GIL: the engine thread adds to it.
        yield from self._families(dict(s.jobs), s.tokens, s.failed_steps, s.store_retries,
                                  s.preempted, dict(s.tenant_tokens),
                                  (s.prefix_query_tokens, s.prefix_hit_tokens))

    def _families(self, jobs: dict[str, int], tokens: int, failed_steps: int,
                  store_retries: int, preempted: int,
                  tenant_tokens: dict[str, int] | None = None,
                  prefix: tuple[int, int] = (0, 0)) -> Iterator[CounterMetricFamily]:
        created = self._stats.started_at
        family = CounterMetricFamily("tokenfleet_jobs", "Jobs that ended here, by final status",
                                     labels=["queue", "status"])
        for status, n in sorted(jobs.items()):
            family.add_metric([self._queue, status], n, created=created)
        yield family
        family = CounterMetricFamily("tokenfleet_tokens_generated", "Tokens generated",
                                     labels=["queue"])
        family.add_metric([self._queue], tokens, created=created)
        yield family
        family = CounterMetricFamily("tokenfleet_tenant_tokens_generated",
                                     "Tokens of a tenant's jobs that ended here",
                                     labels=["queue", "tenant"])
        for tenant, n in sorted((tenant_tokens or {}).items()):
            family.add_metric([self._queue, tenant], n, created=created)
        yield family
        yield CounterMetricFamily("tokenfleet_failed_steps", "Engine steps that raised",
                                  failed_steps, created=created)
        yield CounterMetricFamily("tokenfleet_store_retries",
                                  "Times Redis refused a step's writes (a lost connection, "
                                  "OOM, READONLY, MISCONF) and they were sent again",
                                  store_retries, created=created)
        yield CounterMetricFamily("tokenfleet_preempted_jobs",
                                  "Batch-level jobs handed back to their queue for live jobs "
                                  "that waited for a slot", preempted, created=created)
        # vLLM's pair (prefix_cache_queries, prefix_cache_hits), in tokens: the
        # hit rate is hits over queries.
        for name, help_, n in (
                ("tokenfleet_prefix_cache_queries",
                 "Prompt tokens of the jobs admitted with a prefix cache", prefix[0]),
                ("tokenfleet_prefix_cache_hit_tokens",
                 "Prompt tokens served from the prefix cache (not computed again)", prefix[1])):
            family = CounterMetricFamily(name, help_, labels=["queue"])
            family.add_metric([self._queue], n, created=created)
            yield family
