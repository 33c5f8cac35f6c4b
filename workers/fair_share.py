"""The tenants of a queue, as the feeder reads them.

A job of a named tenant waits in its tenant's stream of its level
(``level_queue``): one stream per tenant per level, so a worker can take the
next job of any tenant without reading past another tenant's flood. The default
tenant's streams are the level streams a queue without tenants has always had.
``submit.lua`` adds a tenant to the queue's set (``Keys.tenants``) with its
first job; the feeder re-reads that set every ``REFRESH_S``, and after
each block that found nothing, and makes the
consumer group of each new stream before it reads from it.

With fair share on, a read goes through ``fair.lua``: the fleet-wide counters
of virtual tokens decide which tenant's entry comes next (see the script).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from tokenfleet.shared.wire.keys import DEFAULT_TENANT, PRIORITIES, Keys, level_queue
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.topology import ensure_group, level_stream
from tokenfleet.shared.wire.worker_scripts import FairLevel, StreamEntries, fair

# How often a busy feeder looks for tenants new to the queue (an idle one looks
# after each block): a new tenant's first job waits at most this long (or the
# feeder's block) before a worker reads it. One SMEMBERS each time.
REFRESH_S = 0.25


class TenantStreams:
    """The streams of a queue, per level and tenant, and the fair read over them."""

    def __init__(self, redis: Any, keys: Keys, settings: Settings, queue: str,
                 consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.queue = queue
        self.consumer = consumer
        self.tenants: list[str] = [DEFAULT_TENANT]
        self._refreshed = 0.0

    def levels(self, priorities: Iterable[str] = PRIORITIES) -> list[tuple[str, str]]:
        """(level queue name, stream) of every stream of ``priorities`` (all by
        default), highest priority first."""
        return [(level_queue(self.queue, p, t), level_stream(self.keys, self.queue, p, t))
                for p in priorities for t in self.tenants]

    def streams_of(self, priority: str) -> list[str]:
        """The streams of one level: the default tenant's first."""
        return [level_stream(self.keys, self.queue, priority, t) for t in self.tenants]

    def ensure_groups(self, tenants: list[str] | None = None) -> None:
        for priority in PRIORITIES:
            for tenant in tenants or self.tenants:
                ensure_group(self.redis, level_stream(self.keys, self.queue, priority, tenant))

    def refresh(self, force: bool = False) -> bool:
        """Look for tenants new to the queue (every ``REFRESH_S``); True when
        one came (its groups are made before any read names its streams)."""
        now = time.monotonic()
        if not force and now - self._refreshed < REFRESH_S:
            return False
        self._refreshed = now
        named = sorted(t.decode() for t in self.redis.smembers(self.keys.tenants(self.queue)))
        new = [t for t in named if t not in self.tenants and t != DEFAULT_TENANT]
        if new:
            self.ensure_groups(new)
            self.tenants = [DEFAULT_TENANT, *sorted({*self.tenants[1:], *new})]
        return bool(new)

    def weight(self, tenant: str) -> float:
        return self.settings.tenant_weights.get(tenant, 1.0)

    def read_fair(self, shares: dict[str, int], priorities: Iterable[str] = PRIORITIES
                  ) -> list[tuple[str, StreamEntries]]:
        """Read ``shares`` (credits per level) from the levels of ``priorities``
        through ``fair.lua``: (stream, entries) per stream that gave some. A
        level's shortfall goes to the next of ``priorities`` only."""
        levels = [FairLevel(self.keys.fair(self.queue, p), shares.get(p, 0),
                            [(level_stream(self.keys, self.queue, p, t), t, self.weight(t))
                             for t in self.tenants])
                  for p in priorities]
        call = fair(levels, consumer=self.consumer,
                    burst=float(self.settings.fair_share_burst_tokens))
        return call.run(self.redis)
