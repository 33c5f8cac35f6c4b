"""Queues declared as served by an autoscaled pool (``tokenfleet queue create``).

A pool that scales on its queue's backlog (KEDA) may have no worker at all, and
``submit`` refuses a queue no live worker serves (``NoWorker``): the backlog
that would wake the pool could never form. A declaration, one hash per queue
(``Keys.declared``), tells ``submit.lua`` to queue the jobs anyway; a queue not
declared keeps the refusal, so a mistyped model name still fails at once.

With no live worker the submitting client's own limits hold (prompt tokens,
``max_new_tokens``, payload, queue length: ``shared/wire/limits.py``); the worker
that starts checks its own again when it takes each job, and fails one over
them with the limit named. ``min_workers`` is the pool's floor as the operator
set it (the ``ScaledObject``'s ``minReplicaCount``): shown by ``tokenfleet
queue list`` and ``status`` and exported as a metric, so that a pool running
below it can be seen; admission does not depend on it.

A queue may have P partitions (``--partitions``, ``Keys.partitions``): each a
queue of its own in Redis (``<queue>#<p>``, ``tokenfleet.shared.wire.keys``), so one
model's jobs spread over P hash slots, P nodes of a Redis Cluster. A partitioned
queue's declaration is also each partition's, the key ``submit.lua`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.wire.keys import (MAX_PARTITIONS, QUEUE_NAME_RULE, Keys, is_queue_name,
                                    partitions_of)


@dataclass(frozen=True)
class Declared:
    queue: str
    min_workers: int
    created_at: float  # Redis's clock


def check_queue_name(queue: str) -> None:
    if not is_queue_name(queue):
        raise ValueError(f"queue name must be {QUEUE_NAME_RULE}, got {queue!r}")


def declare(r: Any, keys: Keys, queue: str, min_workers: int, now: float,
            partitions: int | None = None) -> bool:
    """Declare ``queue`` (or change its ``min_workers``, and its ``partitions``
    where given); True if it was not declared before."""
    check_queue_name(queue)
    if min_workers < 0:
        raise ValueError(f"min_workers must be 0 or more, got {min_workers}")
    if partitions is not None:
        set_partitions(r, keys, queue, partitions)
    count = queue_partitions(r, keys, queue)
    new = False
    # The queue's own declaration first (its creation time is the queue's), then
    # its partitions': one key each, one slot each on a Cluster.
    for name in dict.fromkeys([queue, *partitions_of(queue, count)]):
        key = keys.declared(name)
        pipe = r.pipeline(transaction=True)
        # HSETNX keeps the first creation time when a declaration is changed.
        pipe.hsetnx(key, "created_at", repr(now))
        pipe.hset(key, "min_workers", min_workers)
        made, _ = pipe.execute()
        new = new or (name == queue and bool(made))
    r.sadd(keys.declared_index, queue)
    return new


def set_partitions(r: Any, keys: Keys, queue: str, count: int) -> None:
    """Give ``queue`` ``count`` partitions (1: none, the queue itself). Clients
    learn it within ``QueuePartitions.TTL_S``; a worker of the queue reads every
    partition it had when it started (``TOKENFLEET_QUEUE=<queue>``), one of a
    partition that one only (``<queue>#<p>``)."""
    check_queue_name(queue)
    if not 1 <= count <= MAX_PARTITIONS:
        raise ValueError(f"partitions must be 1 to {MAX_PARTITIONS}, got {count}")
    if count == 1:
        r.delete(keys.partitions(queue))
    else:
        r.set(keys.partitions(queue), count)


def queue_partitions(r: Any, keys: Keys, queue: str) -> int:
    """How many partitions ``queue`` has (1: the queue itself)."""
    return max(1, int(r.get(keys.partitions(queue)) or 1))


def undeclare(r: Any, keys: Keys, queue: str) -> bool:
    """Take the declaration away (its queued jobs stay queued); True if there was one."""
    check_queue_name(queue)
    parts = partitions_of(queue, queue_partitions(r, keys, queue))
    found = bool(r.delete(keys.declared(queue)))
    r.srem(keys.declared_index, queue)
    for name in parts:
        if name != queue:
            r.delete(keys.declared(name))
    return found


def _parsed(queue: str, fields: dict[bytes, bytes]) -> Declared | None:
    if not fields:
        return None  # deleted between the scan and the read
    return Declared(queue, int(fields.get(b"min_workers", b"0")),
                    float(fields.get(b"created_at", b"0")))


def declared_queues(r: Any, keys: Keys) -> list[Declared]:
    """Every declared queue, by name."""
    names = sorted(q for q in (keys.declared_model(k.decode())
                               for k in r.scan_iter(match=keys.declared_pattern(), count=500))
                   if is_queue_name(q))  # a partition's declaration is its queue's
    found = [_parsed(q, r.hgetall(keys.declared(q))) for q in names]
    return [d for d in found if d is not None]


async def indexed_declared(r: Any, keys: Keys) -> list[Declared]:
    """Every declared queue, read from the index (no scan: a page's read); a
    queue declared before the index existed shows once declared again."""
    names = sorted(n.decode() for n in await r.smembers(keys.declared_index))
    pipe = r.pipeline(transaction=False)
    for q in names:
        pipe.hgetall(keys.declared(q))
    found = [_parsed(q, fields) for q, fields in zip(names, await pipe.execute())]
    return [d for d in found if d is not None]


async def declared_queues_async(r: Any, keys: Keys) -> list[Declared]:
    """``declared_queues`` on an asyncio client."""
    names = sorted([q async for k in r.scan_iter(match=keys.declared_pattern(), count=500)
                    if is_queue_name(q := keys.declared_model(k.decode()))])
    found = [_parsed(q, await r.hgetall(keys.declared(q))) for q in names]
    return [d for d in found if d is not None]
