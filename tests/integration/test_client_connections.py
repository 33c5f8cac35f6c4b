"""The blocking client keeps its pub/sub connections from one ``wait()`` or
``stream()`` to the next, and a kept connection never hears a channel it left."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.client.pubsub_pool import PubSubPool
from tokenfleet.shared.redis.connect import connect
from tokenfleet.shared.wire.schemas import JobStatus

pytestmark = pytest.mark.timeout(120)


def connections_made(client: FleetClient) -> int:
    """Connections the client's pool has opened so far, its pub/sub's among them
    (the server's own count takes in the worker's: its pool grows when its
    threads first overlap, whenever that happens)."""
    pool = client.redis.connection_pool
    # A blocking pool (FleetClient's) keeps every connection it made in a list.
    made = getattr(pool, "_created_connections", None)
    return int(made) if made is not None else len(pool._connections)


@pytest.mark.slow
def test_waits_and_streams_one_after_another_open_no_new_connection(
        client: FleetClient, start_worker: Any) -> None:
    start_worker()
    job_ids = [client.submit(f"connections {i}", max_new_tokens=16, temperature=0.0)
               for i in range(8)]
    first = [client.wait(j, timeout=60) for j in job_ids]  # the worker idle from here on
    waits_in_vain = client.submit("never runs", model="nobody", require_worker=False)
    before = connections_made(client)
    for i, job_id in enumerate(job_ids):
        if i % 2:
            assert client.wait(job_id, timeout=60) == first[i]
        else:
            assert "".join(e.text for e in client.stream(job_id, timeout=60)) == first[i].text
        with pytest.raises(TimeoutError):  # the caller's deadline: its connection is kept too
            client.wait(waits_in_vain, timeout=0.05)
    assert all(s.status is JobStatus.SUCCEEDED for s in first)
    # Each call used to connect anew (and send HELLO): sixteen connections.
    assert connections_made(client) - before == 0


@pytest.mark.single_redis("a cluster client's pub/sub connection is not retried: a killed kept "
                          "connection fails its next SUBSCRIBE, and the pool drops it")
def test_a_kept_connection_that_reconnects_hears_only_its_new_channel(
        redis_url: str, r: redis.Redis, namespace: str) -> None:
    old, new = f"{namespace}:old", f"{namespace}:new"
    pool = PubSubPool(connect(redis_url))
    with pool.subscribed(old) as kept:
        for i in range(3):
            r.publish(old, f"left unread {i}")
    # The kept connection dies while idle (a Redis restart, an idle timeout):
    # the next caller's SUBSCRIBE reconnects it.
    host, port = kept.connection._sock.getsockname()[:2]
    assert r.client_kill_filter(addr=f"{host}:{port}") == 1
    with pool.subscribed(new) as pubsub:
        assert pubsub is kept
        r.publish(old, "published on the old channel")
        r.publish(new, "published on the new channel")
        heard = []
        while (message := pubsub.get_message(timeout=0.5)) is not None:
            heard.append(message["data"])
    pool.close()
    assert heard == [b"published on the new channel"]
