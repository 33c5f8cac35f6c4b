"""Queues declared as served by an autoscaled pool (``tokenfleet queue create``).

A pool that scales on its queue's backlog (KEDA) may have no worker at all, and
``submit`` refuses a queue no live worker serves (``NoWorker``): the backlog
that would wake the pool could never form. A declaration, one hash per queue
(``Keys.declared``), tells ``submit.lua`` to queue the jobs anyway; a queue not
declared keeps the refusal, so a mistyped model name still fails at once.

With no live worker the submitting client's own limits hold (prompt tokens,
``max_new_tokens``, payload, queue length: ``shared/limits.py``); the worker
that starts checks its own again when it takes each job, and fails one over
them with the limit named. ``min_workers`` is the pool's floor as the operator
set it (the ``ScaledObject``'s ``minReplicaCount``): shown by ``tokenfleet
queue list`` and ``status`` and exported as a metric, so that a pool running
below it can be seen; admission does not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.keys import QUEUE_NAME_RULE, Keys, is_queue_name


@dataclass(frozen=True)
class Declared:
    queue: str
    min_workers: int
    created_at: float  # Redis's clock


def check_queue_name(queue: str) -> None:
    if not is_queue_name(queue):
        raise ValueError(f"queue name must be {QUEUE_NAME_RULE}, got {queue!r}")


def declare(r: Any, keys: Keys, queue: str, min_workers: int, now: float) -> bool:
    """Declare ``queue`` (or change its ``min_workers``); True if it was not declared before."""
    check_queue_name(queue)
    if min_workers < 0:
        raise ValueError(f"min_workers must be 0 or more, got {min_workers}")
    key = keys.declared(queue)
    pipe = r.pipeline(transaction=True)  # one key: one slot on a Cluster too
    # HSETNX keeps the first creation time when a declaration is changed.
    pipe.hsetnx(key, "created_at", repr(now))
    pipe.hset(key, "min_workers", min_workers)
    new, _ = pipe.execute()
    return bool(new)


def undeclare(r: Any, keys: Keys, queue: str) -> bool:
    """Take the declaration away (its queued jobs stay queued); True if there was one."""
    check_queue_name(queue)
    return bool(r.delete(keys.declared(queue)))


def _parsed(queue: str, fields: dict[bytes, bytes]) -> Declared | None:
    if not fields:
        return None  # deleted between the scan and the read
    return Declared(queue, int(fields.get(b"min_workers", b"0")),
                    float(fields.get(b"created_at", b"0")))


def declared_queues(r: Any, keys: Keys) -> list[Declared]:
    """Every declared queue, by name."""
    names = sorted(keys.declared_model(k.decode())
                   for k in r.scan_iter(match=keys.declared_pattern(), count=500))
    found = [_parsed(q, r.hgetall(keys.declared(q))) for q in names]
    return [d for d in found if d is not None]


async def declared_queues_async(r: Any, keys: Keys) -> list[Declared]:
    """``declared_queues`` on an asyncio client."""
    names = sorted([keys.declared_model(k.decode())
                    async for k in r.scan_iter(match=keys.declared_pattern(), count=500)])
    found = [_parsed(q, await r.hgetall(keys.declared(q))) for q in names]
    return [d for d in found if d is not None]
