"""A worker's limits in Redis, where ``submit.lua`` reads them.

The heartbeat writes this worker's ``QueueLimits`` as its field of the queue's
``<ns>:limits:{<queue>}`` hash and renews the hash's TTL, so it expires once no
worker of the queue is live (then a client's own settings hold). A worker that
stops takes its field out; one that died leaves it until another worker of the
queue beats and finds it no longer live (``forget_dead``).
"""

from __future__ import annotations

import math
from typing import Any

from tokenfleet.shared.redis import liveness
from tokenfleet.shared.wire.keys import Keys


def publish(pipe: Any, keys: Keys, queue: str, name: str, limits_json: str,
            heartbeat_s: float) -> None:
    """Queue on ``pipe`` (the heartbeat's) this worker's limits and the hash's TTL."""
    key = keys.limits(queue)
    pipe.hset(key, name, limits_json)
    pipe.expire(key, math.ceil(liveness.live_for_s(heartbeat_s)))


def forget_dead(redis: Any, keys: Keys, queue: str, now: float) -> None:
    """Take out the fields of workers no longer live: a dead worker's limits
    must not hold the queue's requests to what it allowed. ``now``: Redis's clock."""
    pipe = redis.pipeline(transaction=False)
    pipe.hkeys(keys.limits(queue))
    pipe.zrangebyscore(keys.queue_workers(queue), liveness.live_since(now), "+inf")
    published, live = pipe.execute()
    # A worker that beats between these reads and the delete writes its field
    # again with its next beat; until then its limits are left out (the worker
    # still checks them itself when it takes a job).
    dead = set(published) - set(live)
    if dead:
        redis.hdel(keys.limits(queue), *dead)


def withdraw(redis: Any, keys: Keys, queue: str, name: str) -> None:
    """Take this worker's limits out: it no longer takes the queue's jobs."""
    redis.hdel(keys.limits(queue), name)
