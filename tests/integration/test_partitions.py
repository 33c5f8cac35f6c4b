"""Partitioned queues: one model's jobs spread over P partitions, each a queue of
its own in Redis (``<queue>#<p>``, its keys in its own hash slot). A worker
named for the queue (``TOKENFLEET_QUEUE=<queue>``) reads every partition, its
credits shared among them; one named for a partition (``<queue>#<p>``) reads
that one only.

- on a Redis Cluster of three masters, a queue of three partitions (one on each
  master) under 300 jobs, served by two workers that read every partition:
  every job whole, and each master's share of the commands (``INFO
  commandstats``, before and after) within 15% of a third;
- one worker of the queue with a backlog on every partition takes its jobs
  from the partitions in turn, a third from each;
- on one redis-server, the same queue (made with ``tokenfleet queue create
  --partitions``): jobs spread over the partitions, the
  same idempotency key lands on its first job, a queued job cancels, and
  ``status`` and the backlog exporter sum the partitions into one queue;
- a partition's worker killed with SIGKILL mid-run: its jobs are resumed by
  the partition's next worker, each whole and ended once; the same for a worker
  of every partition, its jobs in both partitions resumed by the next one;
- a queue of one partition keeps its names: ids ``<queue>:<hex>``, keys ``{<queue>}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.declared import queue_partitions, set_partitions
from tokenfleet.shared.wire.keys import Keys, job_model, partitions_of
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.wire.serialization import loads

from helpers import (ChannelTally, RedisClusterServers, RedisServer, direct_greedy,
                     wait_until)
from placed_kill import frozen_mid_job

pytestmark = [pytest.mark.timeout(240)]

PARTS = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(masters=3)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def redis_url(cluster: RedisClusterServers) -> str:
    """This module's Redis is a cluster of three masters, whatever ``--redis`` says."""
    return cluster.url


def spread_queue(r: Any, keys: Keys) -> str:
    """A queue name whose three partitions' slots lie on three different masters
    (slots are hashed: with P = masters a name may put two on one master)."""
    for i in range(1000):
        name = f"spread{i}"
        nodes = {r.get_node_from_key(keys.queue(p)).name for p in partitions_of(name, PARTS)}
        if len(nodes) == PARTS:
            return name
    raise AssertionError("no name spreads its partitions over every master")


def command_counts(nodes: list[RedisServer]) -> list[int]:
    """Commands each node has run so far (``INFO commandstats``, every command)."""
    counts = []
    for node in nodes:
        probe = redis.Redis(port=node.port)
        stats = probe.info("commandstats")
        probe.close()
        counts.append(sum(int(v["calls"]) for v in stats.values()))
    return counts


def start_partition_workers(start_worker: Any, queue: str, **overrides: Any) -> list[Any]:
    return [start_worker(f"w{p}@parts", queue=name, **overrides)
            for p, name in enumerate(partitions_of(queue, PARTS))]


def whole(r: Any, keys: Keys, job_id: str, state: Any) -> bool:
    """Succeeded, with a gap-free token log that holds the result's tokens."""
    logged = [t for _id, fields in r.xrange(keys.out(job_id))
              for t in loads(fields[b"e"]).get("token_ids", [])]
    return state.status is JobStatus.SUCCEEDED and logged == list(state.token_ids)


def test_three_partitions_spread_a_queue_evenly_over_three_masters(
    settings: Any, client: FleetClient, r: Any, start_worker: Any,
    cluster: RedisClusterServers,
) -> None:
    keys = Keys.for_url(settings.namespace, settings.redis_url)
    queue = spread_queue(r, keys)
    set_partitions(r, keys, queue, PARTS)
    for name in ("a@parts", "b@parts"):  # each reads every partition
        start_worker(name, queue=queue)
    nodes = cluster.nodes  # three masters, no replicas
    before = command_counts(nodes)
    ids = [client.submit(f"job {i} of a partitioned queue", model=queue, max_new_tokens=6,
                         temperature=0.0) for i in range(300)]
    states = [client.wait(j, timeout=120) for j in ids]
    after = command_counts(nodes)
    per_part = {p: sum(1 for j in ids if job_model(j) == p) for p in partitions_of(queue, PARTS)}
    assert set(per_part.values()) == {100}, per_part  # one client deals them in turn
    assert all(whole(r, keys, j, s) for j, s in zip(ids, states))
    delta = [a - b for a, b in zip(after, before)]
    shares = [d / sum(delta) for d in delta]
    print(f"\njobs per partition {per_part}; commands per master {delta}, "
          f"shares {[round(s, 3) for s in shares]}")
    assert all(abs(s - 1 / PARTS) <= 0.15 / PARTS for s in shares), (delta, shares)


def test_a_worker_of_the_queue_takes_from_every_partition_in_turn(
    settings: Any, client: FleetClient, r: Any, start_worker: Any,
) -> None:
    """Its credits are shared fairly: with a backlog on each partition, the
    jobs it starts come from the partitions in turn, not one drained first.
    One slot, so that a credit comes free at a time, whichever feeder's thread
    wakes first (two jobs that end in the same step free two at once, and the
    feeder that comes second may take the next partition's turn: see
    ``workers/shared_credits.py``)."""
    keys = Keys.for_url(settings.namespace, settings.redis_url)
    set_partitions(r, keys, "turns", PARTS)
    ids = [client.submit(f"job {i}", model="turns", max_new_tokens=3, temperature=0.0,
                         require_worker=False) for i in range(60)]
    worker = start_worker("one@parts", queue="turns", max_batch=1, prefetch=1)
    assert worker.partitions == partitions_of("turns", PARTS)
    states = [client.wait(j, timeout=120) for j in ids]
    assert all(whole(r, keys, j, s) for j, s in zip(ids, states))
    started = sorted(ids, key=lambda j: float(r.hget(keys.job(j), "started_at") or 0))
    first = [job_model(j) for j in started[:30]]
    counts = {p: first.count(p) for p in partitions_of("turns", PARTS)}
    print(f"\nthe first 30 jobs started, by partition: {counts}")
    assert all(7 <= n <= 13 for n in counts.values()), counts


@pytest.fixture
def single(redis_server: RedisServer, settings: Any) -> Iterator[Any]:
    """This test's settings on one redis-server instead of the cluster."""
    yield settings.model_copy(update={"redis_url": redis_server.url})


def cli(settings: Any, *args: str) -> Any:
    from click.testing import CliRunner

    from tokenfleet.shared.settings import get_settings
    from tokenfleet.cli.app import main

    result = CliRunner().invoke(main, list(args), env={
        "TOKENFLEET_REDIS_URL": settings.redis_url, "TOKENFLEET_NAMESPACE": settings.namespace})
    get_settings.cache_clear()  # read under the runner's environment: not this process's
    return result


def test_a_partitioned_queue_on_one_redis(single: Any, start_worker: Any) -> None:
    keys = Keys(single.namespace)
    with FleetClient(settings=single) as client:
        r = client.redis
        made = cli(single, "queue", "create", "parts", "--partitions", str(PARTS))
        assert made.exit_code == 0 and f"{PARTS} partitions" in made.output, made.output
        assert queue_partitions(r, keys, "parts") == PARTS
        listed = cli(single, "queue", "list")
        assert listed.output.count("parts") == 1, listed.output  # its partitions: one row
        # Queued ahead of the workers: one stays queued to be cancelled.
        ids = [client.submit(f"job {i}", model="parts", max_new_tokens=4, temperature=0.0,
                             require_worker=False) for i in range(30)]
        assert {job_model(j) for j in ids} == set(partitions_of("parts", PARTS))
        first = client.submit("once", model="parts", max_new_tokens=4, idempotency_key="k-1",
                              require_worker=False)
        assert client.submit("once", model="parts", max_new_tokens=4, idempotency_key="k-1",
                             require_worker=False) == first
        doomed = ids.pop()
        client.cancel(doomed)
        from tokenfleet.client.fleet import fleet_status

        row = next(q for q in fleet_status(client)["queues"] if q["queue"] == "parts")
        assert row["partitions"] == PARTS and row["depth"] == len(ids) + 1, row
        # What an autoscaler reads: the queue once, its partitions' jobs summed.
        from prometheus_client import generate_latest

        from tokenfleet.exporter.backlog import registry

        text = generate_latest(registry(r, keys)).decode()
        assert f'tokenfleet_queue_backlog{{priority="normal",queue="parts"}} {len(ids) + 1}.0' \
            in text and "parts#" not in text, text
        start_partition_workers(start_worker, "parts", redis_url=single.redis_url)
        states = [client.wait(j, timeout=60) for j in [*ids, first]]
        assert all(whole(r, keys, j, s) for j, s in zip([*ids, first], states))
        assert client.wait(doomed, timeout=5).status is JobStatus.CANCELLED
        wait_until(lambda: next(q for q in fleet_status(client)["queues"]
                                if q["queue"] == "parts")["workers"] == PARTS, timeout=10,
                   what="status to count a worker of each partition")


def test_a_queue_of_one_partition_keeps_its_names() -> None:
    from tokenfleet.client.protocol import pick_partition
    from tokenfleet.shared.wire.schemas import GenerationRequest

    keys = Keys("ns")
    assert partitions_of("default", 1) == ["default"]
    request = GenerationRequest(prompt="x", model="default")
    assert pick_partition(request, 1) == "default"
    assert keys.queue("default") == "ns:q:{default}"
    assert keys.job("default:ab") == "ns:job:{default}:ab"
    assert keys.job("default#2:ab") == "ns:job:{default#2}:ab"
    assert keys.queue("default#2:high") == "ns:q:{default#2}:high"
    same = request.model_copy(update={"idempotency_key": "k"})
    assert len({pick_partition(same, 3) for _ in range(5)}) == 1


@pytest.mark.slow
def test_kill_9_of_a_partitions_worker_loses_nothing_and_runs_nothing_twice(
    settings: Any, client: FleetClient, r: Any, start_worker: Any, celery_workers: Any,
    loaded_tiny: Any,
) -> None:
    """A partition is a queue of its own: a worker of it killed mid-run, its
    jobs are reclaimed and resumed by the partition's next worker, and the
    other partition's worker never notices."""
    keys = Keys.for_url(settings.namespace, settings.redis_url)
    set_partitions(r, keys, "killed", 2)
    first, second = partitions_of("killed", 2)
    jobs = [(f"job {i} the value of a list", 30 + (i * 7) % 30) for i in range(24)]
    ids = [client.submit(p, model="killed", max_new_tokens=n, temperature=0.0,
                         require_worker=False) for p, n in jobs]
    tally = ChannelTally(settings.redis_url, keys, ids)
    victim = celery_workers("cpu@victim", TOKENFLEET_QUEUE=first, TOKENFLEET_MAX_BATCH="4")
    start_worker("other@parts", queue=second)

    with frozen_mid_job(victim.proc, r, keys, "cpu@victim", ids) as in_flight:
        victim.kill()  # SIGKILL: its pending entries stay with cpu@victim
    start_worker("next@parts", queue=first, claim_idle_s=2)
    states = [client.wait(j, timeout=120) for j in ids]
    tally.wait_ended(ids, timeout=30)
    tally.close()
    assert [s.text for s in states] == direct_greedy(loaded_tiny, jobs)
    assert all(whole(r, keys, j, s) for j, s in zip(ids, states))
    assert all(s.attempts == 2 for j, s in zip(ids, states) if j in in_flight), in_flight
    assert all(s.attempts == 1 for j, s in zip(ids, states) if job_model(j) == second)
    assert tally.ends_not_once(ids) == {} and tally.duplicated == 0


@pytest.mark.slow
def test_kill_9_of_a_worker_of_every_partition_loses_nothing_and_runs_nothing_twice(
    settings: Any, client: FleetClient, r: Any, start_worker: Any, celery_workers: Any,
    loaded_tiny: Any,
) -> None:
    """A worker that reads every partition killed mid-run: its jobs of both
    partitions are reclaimed, each in its partition, by the next such worker."""
    keys = Keys.for_url(settings.namespace, settings.redis_url)
    set_partitions(r, keys, "every", 2)
    jobs = [(f"job {i} the value of a list", 30 + (i * 7) % 30) for i in range(24)]
    ids = [client.submit(p, model="every", max_new_tokens=n, temperature=0.0,
                         require_worker=False) for p, n in jobs]
    tally = ChannelTally(settings.redis_url, keys, ids)
    victim = celery_workers("cpu@victim", TOKENFLEET_QUEUE="every", TOKENFLEET_MAX_BATCH="6")

    def of_both(running: list[str]) -> bool:
        return {job_model(j) for j in running} == set(partitions_of("every", 2))

    with frozen_mid_job(victim.proc, r, keys, "cpu@victim", ids, enough=of_both):
        victim.kill()  # SIGKILL: its pending entries in both partitions stay with cpu@victim
    start_worker("next@every", queue="every", claim_idle_s=2)
    states = [client.wait(j, timeout=120) for j in ids]
    tally.wait_ended(ids, timeout=30)
    tally.close()
    assert [s.text for s in states] == direct_greedy(loaded_tiny, jobs)
    assert all(whole(r, keys, j, s) for j, s in zip(ids, states))
    resumed = {job_model(j) for j, s in zip(ids, states) if s.attempts > 1}
    assert resumed == set(partitions_of("every", 2)), resumed
    assert tally.ends_not_once(ids) == {} and tally.duplicated == 0
