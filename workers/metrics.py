"""Prometheus metrics of one worker process (``--metrics-port``).

Names follow Prometheus conventions: counters end in ``_total``, durations are
``_seconds`` histograms. Queue gauges (depth, lag, pending, backlog) describe
the whole queue as this worker sees it, so every worker of a queue reports the
same value: aggregate them with ``max``. ``tokenfleet_backlog_tokens`` (queued
prompt tokens, estimated, plus requested ``max_new_tokens``) is a better
autoscaling signal than an entry count: it weighs long jobs as long.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tokenfleet.workers.sequence import SeqOutput
from tokenfleet.workers.step_histogram import StepHistogram

LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self, queue: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue = queue
        self.jobs = Counter("tokenfleet_jobs_total", "Jobs that ended here, by final status",
                            ["queue", "status"], registry=r)
        self.tokens = Counter("tokenfleet_tokens_generated_total", "Tokens generated",
                              ["queue"], registry=r)
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
        self.depth = Gauge("tokenfleet_queue_depth", "Jobs waiting or running in the queue",
                           ["queue", "priority"], registry=r)
        self.lag = Gauge("tokenfleet_consumer_group_lag", "Entries no worker has read yet",
                         ["queue", "priority"], registry=r)
        self.pending = Gauge("tokenfleet_pending_entries", "Entries read but not acknowledged",
                             ["queue", "priority"], registry=r)
        self.backlog = Gauge("tokenfleet_backlog_tokens", "Queued work in tokens (prompt "
                             "estimate plus max_new_tokens)", ["queue"], registry=r)
        self.failed_steps = Counter("tokenfleet_failed_steps_total",
                                    "Forward passes that raised", registry=r)
        self.store_retries = Counter("tokenfleet_store_retries_total",
                                     "Times Redis refused a step's writes (a lost connection, "
                                     "OOM, READONLY, MISCONF) and they were sent again",
                                     registry=r)
        self.running = Gauge("tokenfleet_running_sequences", "Sequences in the running batch",
                             registry=r)
        # This queue's children, looked up once: the engine observes every token.
        self._ttft, self._itl = self.ttft.labels(queue), self.itl.labels(queue)
        self._tokens = self.tokens.labels(queue)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def started(self, created_at: float | None) -> None:
        if created_at is not None:
            self.queue_wait.labels(self.queue).observe(max(0.0, time.time() - created_at))

    def step_done(self, batch_size: int, seconds: float, outputs: list[SeqOutput]) -> None:
        if batch_size:
            self.batch_size.observe(batch_size)
            self.step.observe(seconds)
        now = time.monotonic()
        made = 0
        # Sequences whose last token came in the same step share their latency:
        # counted by that step's time, observed once per distinct value.
        last_at: dict[float, int] = {}
        for o in outputs:
            seq = o.seq
            if o.token_id is not None:
                made += 1
                if seq.last_token_at is None:
                    if seq.created_at is not None:
                        self._ttft.observe(max(0.0, time.time() - seq.created_at))
                else:
                    last_at[seq.last_token_at] = last_at.get(seq.last_token_at, 0) + 1
                seq.last_token_at = now
            if o.finished:
                self.jobs.labels(self.queue, seq.final_status.value).inc()
        for at, n in last_at.items():
            self._itl.observe(now - at, n)
        if made:
            self._tokens.inc(made)

    def queue_state(self, levels: dict[str, dict[str, Any]], backlog: int, running: int) -> None:
        for priority, info in levels.items():
            self.depth.labels(self.queue, priority).set(info["depth"])
            self.lag.labels(self.queue, priority).set(info["lag"])
            self.pending.labels(self.queue, priority).set(info["pending"])
        self.backlog.labels(self.queue).set(backlog)
        self.running.set(running)
