"""One Redis Cluster node killed with SIGKILL while a worker serves a queue whose
keys live on another master: the worker goes on serving it.

- without replicas: the dead master's slots stay unserved (the cluster does not
  require full coverage), and a job of the healthy queue submitted after the
  kill runs at once, from a producer that was running and from one that
  started after the kill;
- with replicas: the same after the dead master's replica has taken over;
- the heartbeat: the worker's hash on the dead node, its queue on another, and
  the queue stays served;
- the cancel listener: a cancel of a running job reaches its worker after the
  node that held the cancels channel's slot died.

The node killed is the one each fresh cluster client calls its default node
(the one it asks what it does not know of the slot map), or the one that holds
the channel; the worker's own queue is on another master. Each test makes a
cluster of its own, and runs with ``--redis cluster`` only (the fault suite's
second run).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus
from tokenfleet.workers.runner import HFRunner

from helpers import RedisClusterServers, RedisServer, logged_count, redis_client, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180), pytest.mark.one_partition(
    "the worker's queue must lie on one master that stays up; a queue of three partitions "
    "spreads over every master")]

CANDIDATE_QUEUES = ("default", "other", "third", "fourth", "fifth", "sixth")
# The bound: a job of a healthy queue submitted after a master died
# succeeds within this many seconds.
SERVED_WITHIN_S = 10.0


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[RedisClusterServers]:
    if request.config.getoption("--redis") != "cluster":
        pytest.skip("kills a Redis Cluster node: runs with --redis cluster")
    servers = RedisClusterServers(masters=3, replicas=getattr(request, "param", 0),
                                  node_timeout_ms=1000, full_coverage=False)
    yield servers
    servers.close()


@pytest.fixture
def redis_url(cluster: RedisClusterServers) -> str:
    """conftest's ``settings``, ``r`` and ``client`` follow this test's cluster."""
    return cluster.url


class SlowRunner(HFRunner):
    """The real model at a big model's pace, so a job is mid-generation when the test acts."""

    def run(self, batch):  # type: ignore[no-untyped-def]
        time.sleep(0.05)  # simulated compute time, not synchronisation
        return super().run(batch)


def node_of(cluster: RedisClusterServers, r: Any, key: str) -> RedisServer:
    port = int(r.get_node_from_key(key).port)
    return next(n for n in cluster.nodes if n.port == port)


def healthy_queue(cluster: RedisClusterServers, r: Any, keys: Keys, victim: RedisServer) -> str:
    return next(q for q in CANDIDATE_QUEUES if node_of(cluster, r, keys.queue(q)) is not victim)


def default_node(cluster: RedisClusterServers, r: Any) -> RedisServer:
    """The node a fresh cluster client (the worker's, the test's) calls its default."""
    port = int(r.get_default_node().port)
    return next(n for n in cluster.nodes if n.port == port)


def worker_named(cluster: RedisClusterServers, r: Any, keys: Keys, victim: RedisServer,
                 on_victim: bool) -> str:
    """A worker name whose heartbeat hash lives on ``victim`` or not."""
    return next(name for name in (f"w{i}@cluster" for i in range(1000))
                if (node_of(cluster, r, keys.worker(name)) is victim) == on_victim)


def serves_after_kill(cluster: RedisClusterServers, settings: Any, client: FleetClient,
                      start_worker: Any, r: Any, replicas: int) -> None:
    keys = Keys(settings.namespace)
    victim = default_node(cluster, r)
    queue = healthy_queue(cluster, r, keys, victim)
    # The worker's hash is elsewhere: nothing the worker sends meets the dead
    # node but what it asks of its default node (a write there would make the
    # client replace its default node, by chance).
    name = worker_named(cluster, r, keys, victim, on_victim=False)
    worker = start_worker(name, queue=queue)
    before = client.submit("before the kill", max_new_tokens=4, model=queue)
    assert client.wait(before, timeout=60).status is JobStatus.SUCCEEDED

    served = keys.queue_workers(queue)
    beat_before = float(r.zscore(served, name))
    if replicas:
        # A replica takes over only once it has been in sync with its master.
        probe = redis.Redis(port=victim.port)
        wait_until(lambda: int(probe.execute_command("WAIT", 1, 1000)) >= 1, timeout=30,
                   what="the victim's replica to be in sync")
        probe.close()
    victim.kill()
    if replicas:
        # A fresh client reads the slot map: the dead master's slots have a new one.
        alive = next(n for n in cluster.nodes if n is not victim)

        def promoted() -> bool:
            fresh = redis_client(f"redis+cluster://127.0.0.1:{alive.port}")
            try:
                return all(node_of(cluster, fresh, keys.queue(q)) is not victim
                           for q in CANDIDATE_QUEUES)
            finally:
                fresh.close()

        wait_until(promoted, timeout=60, what="a replica to take the dead master's place")

    after = client.submit("after the kill", max_new_tokens=4, model=queue)
    state = client.wait(after, timeout=SERVED_WITHIN_S)
    assert state.status is JobStatus.SUCCEEDED, (state, worker.name)
    # A second job, from a producer that starts after the kill (given a live
    # node): the first may have been taken by a read under way at the kill.
    live = next(n for n in cluster.nodes if n is not victim)
    late = settings.model_copy(update={"redis_url": f"redis+cluster://127.0.0.1:{live.port}"})
    with FleetClient(settings=late) as producer:
        later = producer.submit("a later producer", max_new_tokens=4, model=queue)
        assert producer.wait(later, timeout=SERVED_WITHIN_S).status is JobStatus.SUCCEEDED
        # The first cancel on the queue's node: its script is not there yet,
        # and is sent to that node alone, not to every master (one is dead).
        assert producer.cancel(later) is False  # it had ended: nothing to cancel
    wait_until(lambda: float(r.zscore(served, name)) > beat_before, timeout=30,
               what="a heartbeat after the kill")


def test_a_dead_master_does_not_stop_intake_of_a_queue_on_another_master(
    cluster: RedisClusterServers, settings: Any, client: FleetClient, start_worker: Any,
    r: Any,
) -> None:
    serves_after_kill(cluster, settings, client, start_worker, r, replicas=0)


@pytest.mark.parametrize("cluster", [1], indirect=True, ids=["replicas"])
def test_after_a_failover_a_queue_on_another_master_is_served(
    cluster: RedisClusterServers, settings: Any, client: FleetClient, start_worker: Any,
    r: Any,
) -> None:
    serves_after_kill(cluster, settings, client, start_worker, r, replicas=1)


def test_the_heartbeat_keeps_a_queue_served_when_the_workers_hash_node_died(
    cluster: RedisClusterServers, settings: Any, client: FleetClient, start_worker: Any,
    r: Any,
) -> None:
    # The worker's hash is on a node that dies; its queue is on another. The
    # heartbeat still renews the worker's place in the queue's served set, so
    # submits are not refused as having no worker once the last renewal ran out.
    keys = Keys(settings.namespace)
    victim = default_node(cluster, r)
    queue = healthy_queue(cluster, r, keys, victim)
    name = worker_named(cluster, r, keys, victim, on_victim=True)
    start_worker(name, queue=queue)
    served = keys.queue_workers(queue)
    beat_before = float(r.zscore(served, name))
    victim.kill()
    wait_until(lambda: float(r.zscore(served, name)) > beat_before, timeout=30,
               what="a heartbeat after the kill")
    job_id = client.submit("still served", max_new_tokens=4, model=queue)
    assert client.wait(job_id, timeout=SERVED_WITHIN_S).status is JobStatus.SUCCEEDED


def test_a_cancel_reaches_the_worker_after_the_channels_node_died(
    cluster: RedisClusterServers, settings: Any, client: FleetClient, start_worker: Any,
    r: Any, loaded_tiny: Any,
) -> None:
    keys = Keys(settings.namespace)
    victim = node_of(cluster, r, keys.cancels)
    queue = healthy_queue(cluster, r, keys, victim)
    model, tokenizer = loaded_tiny
    start_worker("w1@cancels", runner=SlowRunner(model, tokenizer), queue=queue)
    # A cancel of an ended job: the cancel script is on the queue's node
    # before the kill, so what follows is the listener's part alone.
    short = client.submit("a short one", max_new_tokens=2, model=queue)
    assert client.wait(short, timeout=60).status is JobStatus.SUCCEEDED
    assert not client.cancel(short)
    job_id = client.submit("a long story", max_new_tokens=400, temperature=0.0, model=queue)
    wait_until(lambda: logged_count(r, keys, job_id) >= 2, timeout=60,
               what="the job to be mid-generation")

    victim.kill()
    assert client.cancel(job_id, timeout=SERVED_WITHIN_S), "the cancel never took effect"
    state = client.wait(job_id, timeout=30)
    assert state.status is JobStatus.CANCELLED
    assert state.finish_reason is FinishReason.CANCELLED
    assert len(state.token_ids) < 400
