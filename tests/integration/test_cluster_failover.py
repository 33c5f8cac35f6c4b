"""A Redis Cluster node killed with SIGKILL: a master mid-run, whose replica takes
over while the fleet goes on with nothing lost; and the node an async client's
subscriptions sit on, which move to another node.

Three masters with a replica each (``redis-cli --cluster create --cluster-replicas
1``, a node timeout of one second), a Celery worker on a queue whose slot is on a
master that does not hold Celery's own keys (Celery's broker speaks to one node:
README, "Redis Cluster"), consumers streaming every job. The queue's master is
killed while jobs run; its replica is promoted, the worker's writes go to it, and
every job succeeds with the undisturbed run's text and a whole stream.

Replication is asynchronous: a write the master acknowledged in its last moment
may not have reached the replica. The jobs are on the replica before the kill
(WAIT), so what is checked is the run: every job succeeds, with the undisturbed
run's text, and every consumer's stream is whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import GROUP, Keys
from tokenfleet.shared.wire.schemas import JobStatus

from helpers import RedisClusterServers, direct_greedy, follow_all, stream_fault
from placed_kill import frozen_mid_job

pytestmark = [pytest.mark.timeout(300)]

CANDIDATE_QUEUES = ("default", "other", "third", "fourth", "fifth", "sixth")


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000,
                                  full_coverage=False)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def redis_url(cluster: RedisClusterServers) -> str:
    """conftest's ``settings`` and ``r`` follow this cluster."""
    return cluster.url


def master_port(r: Any, key: str) -> int:
    return int(r.get_node_from_key(key).port)


@pytest.mark.slow
def test_a_master_killed_mid_run_fails_over_and_loses_nothing(
    cluster: RedisClusterServers, settings: Any, client: FleetClient, celery_workers: Any,
    r: Any, loaded_tiny: Any,
) -> None:
    keys = Keys(settings.namespace)
    celery_port = master_port(r, keys.celery_prefix)
    queue = next(q for q in CANDIDATE_QUEUES if master_port(r, keys.queue(q)) != celery_port)
    victim = next(n for n in cluster.nodes if n.port == master_port(r, keys.queue(queue)))

    jobs = [(f"{queue} job {i} the value of a list", 40 + (i * 7) % 40) for i in range(24)]
    ids = [client.submit(p, max_new_tokens=n, temperature=0.0, model=queue,
                         require_worker=False) for p, n in jobs]
    # The replica holds every job before the kill: the kill tests the run, not
    # the loss of a submit the master acknowledged alone.
    subprocess.run(["redis-cli", "-p", str(victim.port), "WAIT", "1", "5000"], check=True,
                   capture_output=True, timeout=10)
    consumers, seen = follow_all(settings, ids)
    worker = celery_workers("cpu@failover", TOKENFLEET_QUEUE=queue, TOKENFLEET_MAX_BATCH="4",
                            TOKENFLEET_CLAIM_IDLE_S="2")
    # The worker frozen while it runs a job, the master dies under it.
    with frozen_mid_job(worker.proc, r, keys, "cpu@failover", ids):
        in_flight = r.xpending(keys.queue(queue), GROUP)["pending"]
        victim.kill()
    states = [client.wait(j, timeout=180) for j in ids]
    consumers.join(timeout=60)

    assert in_flight > 0, "the kill hit no job in flight"
    r.nodes_manager.initialize()  # this client had no reason to read the slot map again
    assert master_port(r, keys.queue(queue)) != victim.port, "no replica took over"
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * len(ids)
    assert [s.text for s in states] == direct_greedy(loaded_tiny, jobs)
    for state in states:
        assert stream_fault(seen[state.id], state) == "", state.id


@pytest.mark.slow
async def test_a_subscription_whose_node_dies_moves_to_another_node() -> None:
    # An async client's streams share one pub/sub connection, to a node picked
    # at random: when that node dies, the subscriptions move to a live one
    # (messages go on arriving), rather than the streams falling back to
    # re-reading their logs every second for good.
    from tokenfleet.shared.redis.connect import connect_async
    from tokenfleet.client.subscriptions import Subscriptions

    servers = RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000,
                                  full_coverage=False)
    client = connect_async(servers.url)
    subscriptions = Subscriptions(client)
    try:
        async with subscriptions.listen("news") as messages:
            port = subscriptions._pubsub.connection.port  # the node it picked
            next(n for n in servers.nodes if n.port == port).kill()
            # Published on a live node: a PUBLISH reaches every node's subscribers.
            publisher = redis.asyncio.Redis(
                port=next(n.port for n in servers.nodes if n.port != port))

            async def heard() -> bytes:
                while True:
                    await publisher.publish("news", b"still here")
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.5):
                            return await messages.get()

            assert await asyncio.wait_for(heard(), timeout=60) == b"still here"
            assert subscriptions._pubsub.connection.port != port
            await publisher.aclose()
    finally:
        await subscriptions.close()
        await client.aclose()
        servers.close()
