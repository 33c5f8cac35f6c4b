"""What a worker gives back as it goes: its jobs to the queue, its name to the fleet."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from redis.exceptions import RedisError

from tokenfleet.shared.wire.keys import Keys, owner_tag
from tokenfleet.workers import limits
from tokenfleet.workers.publisher import Publisher
from tokenfleet.workers.sequence import Sequence

log = logging.getLogger(__name__)


def hand_back(publisher: Publisher, seqs: Iterable[Sequence],
              suspects: frozenset[str] = frozenset()) -> int:
    """Hand ``seqs`` back to the queue (each once); how many went back. A job in
    ``suspects`` may have caused a failed step: its hand-back counts as an attempt."""
    left = list({id(s): s for s in seqs}.values())
    if not left:
        return 0
    try:
        handed: int = publisher.hand_back(left, suspects)
    except RedisError as exc:
        # Redis refuses: the entries stay pending and are reclaimed later.
        log.warning("could not hand jobs back (%s); they will be reclaimed", exc)
        return 0
    return handed


def leave(redis: Any, keys: Keys, name: str, partitions: list[str]) -> None:
    """Take a worker out of the fleet's view: its heartbeat, the served sets and
    the limits it published."""
    try:
        redis.delete(keys.worker(name))
        for part in partitions:
            redis.zrem(keys.queue_workers(part), name)
            limits.withdraw(redis, keys, part, name)
            # No job is placed on its own streams now (workers/affinity.py).
            redis.hdel(keys.owners(part), owner_tag(name))
    except RedisError as exc:
        log.warning("could not remove the heartbeat (%s); it expires", exc)
