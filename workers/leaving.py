"""What a worker gives back as it goes: its jobs to the queue, its name to the fleet."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from redis.exceptions import RedisError

from tokenfleet.shared.wire import worker_scripts
from tokenfleet.shared.wire.keys import Keys, level_owner, owner_tag
from tokenfleet.shared.wire.schemas import queue_entry
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


def unplace(redis: Any, keys: Keys, name: str, partitions: list[str], page: int = 500) -> int:
    """A worker with placement by prefix that stops reading: no job is placed on
    it from now on, and the jobs waiting unread in its own streams go to the
    shared streams (``unplace.lua``), where any worker, and any scaler, finds
    them. How many moved. Should Redis refuse, they stay where they are, and
    its peers take them over once it has left (``steal.lua``)."""
    tag, moved = owner_tag(name), 0
    try:
        for part in partitions:
            redis.hdel(keys.owners(part), tag)
            levels = sorted(m.decode() for m in redis.smembers(keys.owned_levels(part)))
            for level in (lv for lv in levels if level_owner(lv) == tag):
                stream, start = keys.queue(level), "-"
                while entries := redis.xrange(stream, start, "+", count=page):
                    start = "(" + entries[-1][0].decode()
                    for entry_id, fields in entries:
                        entry = queue_entry(fields)
                        if entry is not None:
                            moved += worker_scripts.unplace(
                                keys, level=level, job_id=entry.job_id,
                                entry_id=entry_id.decode()).run(redis)
    except RedisError as exc:
        log.warning("could not move the jobs placed here to the shared streams (%s); the "
                    "other workers take them over", exc)
    if moved:
        log.info("moved %d job(s) placed here to the shared streams", moved)
    return moved


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
