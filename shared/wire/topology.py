"""A queue's streams, named in one place.

A queue of P partitions (``queue create --partitions P``) has, in each
partition, one stream per priority level for the default tenant and one per
level for each named tenant that has queued a job there (``Keys.tenants`` of
the partition). Whatever must see the whole queue (an autoscaler's triggers,
a depth, a feeder) lists its streams here, so that a partition or a tenant
added later is counted everywhere at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from tokenfleet.shared.wire.keys import (
    DEFAULT_TENANT,
    GROUP,
    PRIORITIES,
    Keys,
    level_queue,
    named_tenant,
    owned_level,
    partitions_of,
    queue_of_partition,
)


@dataclass(frozen=True)
class QueueTopology:
    """Partitions x levels x tenants of one queue."""

    keys: Keys
    queue: str
    partitions: int = 1
    # Named tenants (the default tenant always has its streams), in order.
    tenants: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        named = dict.fromkeys(t for t in self.tenants if named_tenant(t) is not None)
        object.__setattr__(self, "tenants", tuple(named))

    @classmethod
    def read(cls, redis: Any, keys: Keys, queue: str,
             tenants: Iterable[str] = ()) -> QueueTopology:
        """The queue as Redis knows it now: its partition count and every tenant
        with a stream in any partition, plus ``tenants``."""
        queue = queue_of_partition(queue)
        count = max(1, int(redis.get(keys.partitions(queue)) or 1))
        known = [*tenants]
        for part in partitions_of(queue, count):
            known += tenants_of(redis, keys, part)
        # Sorted: the same queue renders the same list, whichever partition
        # saw a tenant first.
        return cls(keys, queue, count, tuple(sorted(known)))

    def partition_names(self) -> list[str]:
        names: list[str] = partitions_of(self.queue, self.partitions)
        return names

    def levels(self, partition: str | None = None,
               priorities: Iterable[str] = PRIORITIES) -> list[tuple[str, str, str]]:
        """(partition, priority, tenant) of every stream, or of one partition's:
        partition by partition, highest priority first, the default tenant first."""
        parts = [partition] if partition is not None else self.partition_names()
        return [(part, p, t) for part in parts for p in priorities
                for t in (DEFAULT_TENANT, *self.tenants)]

    def stream(self, partition: str, priority: str, tenant: str | None = None) -> str:
        return level_stream(self.keys, partition, priority, tenant)

    def streams(self, partition: str | None = None,
                priorities: Iterable[str] = PRIORITIES) -> list[str]:
        """Every stream key of the queue (or of one partition)."""
        return [self.stream(*lv) for lv in self.levels(partition, priorities)]


def level_stream(keys: Keys, partition: str, priority: str, tenant: str | None = None,
                 owner: str | None = None) -> str:
    """The stream of one level of one partition for ``tenant`` (the default
    tenant's for None): ``<ns>:q:{default#1}:high:acme``; with ``owner`` (a tag),
    that worker's own stream of it."""
    level = level_queue(partition, priority, tenant)
    key: str = keys.queue(owned_level(level, owner) if owner else level)
    return key


def ensure_group(redis: Any, stream: str) -> None:
    """The workers' group on ``stream`` (made with the stream if need be), from
    its first entry: finished entries are deleted, so whatever is still in the
    stream is waiting for a worker. One already there is left as it is."""
    try:
        redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def tenants_of(redis: Any, keys: Keys, partition: str) -> list[str]:
    """The named tenants with streams in one partition (or unpartitioned queue)."""
    return sorted(_text(t) for t in redis.smembers(keys.tenants(partition)))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
