"""The blocking client keeps its pub/sub connections from one ``wait()`` or
``stream()`` to the next, and a kept connection never hears a channel it left."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.pubsub_pool import PubSubPool
from tokenfleet.shared.redis_conn import connect
from tokenfleet.shared.schemas import JobStatus

pytestmark = pytest.mark.timeout(120)


def connections_made(r: redis.Redis) -> int:
    return int(r.info("stats")["total_connections_received"])


def test_waits_and_streams_one_after_another_open_no_new_connection(
        client: FleetClient, start_worker: Any, r: redis.Redis) -> None:
    start_worker()
    job_ids = [client.submit(f"connections {i}", max_new_tokens=16, temperature=0.0)
               for i in range(8)]
    client.wait(job_ids[0], timeout=60)  # the client's first pub/sub connection
    before = connections_made(r)
    states = []
    for i, job_id in enumerate(job_ids[1:]):
        if i % 2:
            states.append(client.wait(job_id, timeout=60))
        else:
            events = list(client.stream(job_id, timeout=60))
            state = client.status(job_id)
            assert "".join(e.text for e in events) == state.text
            states.append(state)
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 7
    # Each call used to connect anew (and send HELLO): seven connections.
    assert connections_made(r) - before == 0


def test_a_kept_connection_that_reconnects_hears_only_its_new_channel(
        redis_url: str, r: redis.Redis, namespace: str) -> None:
    old, new = f"{namespace}:old", f"{namespace}:new"
    pool = PubSubPool(connect(redis_url))
    with pool.subscribed(old):
        for i in range(3):
            r.publish(old, f"left unread {i}")
    # The kept connection dies while idle (a Redis restart, an idle timeout):
    # the next caller's SUBSCRIBE reconnects it.
    r.client_kill_filter(_type="normal", skipme=True)
    with pool.subscribed(new) as pubsub:
        r.publish(old, "published on the old channel")
        r.publish(new, "published on the new channel")
        heard = []
        while (message := pubsub.get_message(timeout=0.5)) is not None:
            heard.append(message["data"])
    pool.close()
    assert heard == [b"published on the new channel"]
