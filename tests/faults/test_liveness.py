"""Who counts as a live worker: what its own heartbeat says, whatever its period.

A worker writes with each heartbeat the time until which it is live (three of
its heartbeats, ten seconds at least); every reader (``submit``, the served
queues, a second process asking for the same name) compares that time with
Redis's clock, so none needs the worker's ``TOKENFLEET_HEARTBEAT_S``."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.redis.clock import redis_now
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.workers.identity import NameTaken, check_name

from helpers import queue_parts, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]


def test_a_worker_with_a_ten_second_heartbeat_is_live_between_its_beats(
    client: FleetClient, celery_workers: Any, r: redis.Redis, settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, node = Keys(settings.namespace), "cpu@slow-beat"
    celery_workers(node, TOKENFLEET_HEARTBEAT_S="10")
    last_seen, alive_until = (float(v) for v in
                              r.hmget(keys.worker(node), ["last_seen", "alive_until"]))
    # Live until it has missed three beats, as the served set says too (a
    # later beat only moves that time on).
    assert alive_until == pytest.approx(last_seen + 3 * 10)
    served = keys.queue_workers(queue_parts(r, keys)[0])  # the queue's, or a partition's
    wait_until(lambda: r.zscore(served, node) is not None,
               timeout=30, what="the beat's entry in the served set")
    assert (r.zscore(served, node) or 0) >= alive_until

    # Seen 15 s after that beat: past the next beat's time, and past any fixed
    # window of 10 s, yet within three beats.
    later = last_seen + 15
    monkeypatch.setattr(client.clock, "read", lambda _redis: later)
    assert client.served_queues() == ["default"]
    job_id = client.submit("between the beats", max_new_tokens=4)
    monkeypatch.undo()
    assert client.wait(job_id, timeout=60).status is JobStatus.SUCCEEDED


def test_a_name_is_taken_for_as_long_as_its_heartbeat_says(
    r: redis.Redis, settings: Any
) -> None:
    keys, name = Keys(settings.namespace), "gpu0@elsewhere"
    now = redis_now(r)
    # Its last beat is 20 s old, but its period is long: it said it is live 10 s more.
    r.hset(keys.worker(name), mapping={"host": "elsewhere", "pid": 4321,
                                       "last_seen": now - 20, "alive_until": now + 10})
    with pytest.raises(NameTaken, match="in use by process 4321 on elsewhere"):
        check_name(r, keys, name)
    # Past the time it named, it is gone and its name is free.
    r.hset(keys.worker(name), "alive_until", now - 1)
    check_name(r, keys, name)
