"""Every queue's backlog as Prometheus gauges, read from Redis at each scrape:
what ``tokenfleet metrics-exporter`` serves, for dashboards and a KEDA
``prometheus`` trigger on the token-weighted backlog (docs/deploy.md, "What to
scale on, and why": the pools' own triggers read the same job counts from Redis).

A worker's own ``/metrics`` shows its queue too, but a pool scaled to zero has
no worker to export anything: the signal that must wake it comes from a process
that runs whatever the pool's size. The gauges, per queue (``queue`` label, the
``model=`` of a request):

- ``tokenfleet_queue_backlog{queue, priority}``: jobs in the level's stream,
  waiting or running (an entry is deleted when its job ends), so it reads zero
  once the pool has finished everything and not before;
- ``tokenfleet_queue_backlog_tokens{queue}``: that work in tokens (prompt
  estimate plus ``max_new_tokens``), for pools of jobs of very unequal length;
- ``tokenfleet_queue_live_workers{queue}``: workers whose heartbeat counts;
- ``tokenfleet_queue_min_workers{queue}``: a declared queue's floor.

Beside them, each tenant's refusals at the gateways, as the gateways count
them (``tokenfleet.gateway.tenant_refusals``): ``tokenfleet_tenant_refusals_total{tenant, reason}``.

A queue of P partitions (``<queue>#<p>``) is one ``queue``: its partitions'
jobs and tokens summed, a worker that serves several of them counted once.

Every declared queue has its series even when nothing was ever queued, so a
query for it reads 0, not an empty result (which KEDA's Prometheus scaler
takes for an error unless told to ignore it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from tokenfleet.client.fleet import level_streams, queue_models
from tokenfleet.shared.redis.clock import redis_now
from tokenfleet.shared.wire.declared import declared_queues
from tokenfleet.shared.wire.keys import Keys, queue_of_partition
from tokenfleet.shared.redis.liveness import live_since
from tokenfleet.shared.wire.topology import level_stream


class QueueBacklog(Collector):
    """The gauges above, for every queue with a stream or a declaration."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis, self.keys = redis, keys

    def describe(self) -> list[GaugeMetricFamily]:
        return list(_families({}, {}, {}, {}))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        r, keys = self.redis, self.keys
        floors = {d.queue: d.min_workers for d in declared_queues(r, keys)}
        models = sorted({*queue_models(r, keys), *floors})
        since = live_since(redis_now(r))
        # Every tenant's streams of a level count (fair share keeps one per tenant),
        # and the workers' own (placement by prefix).
        streams = {model: level_streams(r, keys, model) for model in models}
        pipe = r.pipeline(transaction=False)
        for model in models:
            for priority, tenant, owner in streams[model]:
                pipe.xlen(level_stream(keys, model, priority, tenant, owner))
            pipe.get(keys.backlog(model))
            pipe.zrangebyscore(keys.queue_workers(model), since, "+inf")
        replies = iter(pipe.execute() if models else [])
        jobs: dict[tuple[str, str], int] = {}
        tokens: dict[str, int] = {}
        workers: dict[str, set[bytes]] = {}
        for model in models:
            queue = queue_of_partition(model)  # a partition's figures are its queue's
            for priority, _, _ in streams[model]:
                jobs[(queue, priority)] = jobs.get((queue, priority), 0) + int(next(replies))
            tokens[queue] = tokens.get(queue, 0) + int(next(replies) or 0)
            workers.setdefault(queue, set()).update(next(replies))
        yield from _families(jobs, tokens, {q: len(names) for q, names in workers.items()},
                             floors)


def _families(jobs: dict[tuple[str, str], int], tokens: dict[str, int],
              workers: dict[str, int], floors: dict[str, int]) -> Iterator[GaugeMetricFamily]:
    backlog = GaugeMetricFamily(
        "tokenfleet_queue_backlog", "Jobs of the queue's priority level waiting or running "
        "(not yet ended): what a pool scales on", labels=["queue", "priority"])
    for (model, priority), n in jobs.items():
        backlog.add_metric([model, priority], n)
    yield backlog
    per_queue = (
        ("tokenfleet_queue_backlog_tokens", "The queue's jobs not yet ended, in tokens (prompt "
         "estimate plus max_new_tokens)", tokens),
        ("tokenfleet_queue_live_workers", "Workers of the queue whose heartbeat counts", workers),
        ("tokenfleet_queue_min_workers", "A declared queue's floor of workers "
         "(tokenfleet queue create --min-workers)", floors),
    )
    for name, text, values in per_queue:
        family = GaugeMetricFamily(name, text, labels=["queue"])
        for model, value in sorted(values.items()):
            family.add_metric([model], value)
        yield family


def registry(redis: Any, keys: Keys) -> CollectorRegistry:
    """A registry holding only the queue gauges and the tenants' refusals (no
    process metrics: the exporter's own are of no use to a scaler)."""
    found = CollectorRegistry(auto_describe=False)
    found.register(QueueBacklog(redis, keys))
    found.register(TenantRefusals(redis, keys))
    return found


class TenantRefusals(Collector):
    """``tokenfleet_tenant_refusals_total{tenant, reason}``, read at each scrape."""

    def __init__(self, redis: Any, keys: Keys) -> None:
        self.redis, self.keys = redis, keys

    def describe(self) -> list[CounterMetricFamily]:
        return [_refusals()]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = _refusals()
        counts = self.redis.hgetall(self.keys.tenant_refusals)
        for name, count in sorted(counts.items()):
            tenant, _, reason = name.decode().partition(":")
            family.add_metric([tenant, reason], int(count))
        yield family


def _refusals() -> CounterMetricFamily:
    return CounterMetricFamily(
        "tokenfleet_tenant_refusals", "Requests of the tenant (an API key's) the gateways "
        "refused, by reason", labels=["tenant", "reason"])
