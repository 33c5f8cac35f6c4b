"""Sharded pub/sub on a Redis Cluster: a job's channels are shard channels.

Three masters with a replica each (a node timeout of one second), an
in-process worker on the tiny model:

- the async and the blocking client and the gateway's SSE stream every token,
  having subscribed with SSUBSCRIBE on the node of the job's slot, and no
  classic PUBLISH is sent;
- over the same jobs streamed, the cluster bus carries no ``publish`` message
  with shard channels, where classic pub/sub sends each event to every node
  (the figures of both are printed);
- a client streaming through a failover of its channel's master (the replica
  takes over, the old master unsubscribes the channel), or through a
  resharding of its slot, gets every token once, from the new node.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tokenfleet import AsyncFleetClient, FleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.wire.serialization import loads

from gateway_server import gateway  # noqa: F401  (a fixture)
from helpers import RedisClusterServers, stream_fault, wait_until

pytestmark = [pytest.mark.timeout(120)]

BUS = ("cluster_stats_messages_publish_sent", "cluster_stats_messages_publish_received",
       "cluster_stats_messages_publishshard_sent",
       "cluster_stats_messages_publishshard_received")
# A cluster bus message's fixed header (clusterMsg, slot bitmap included),
# before the channel and the payload: what each node pays per message it sends.
BUS_HEADER_BYTES = 2256


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000,
                                  full_coverage=False)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def redis_url(cluster: RedisClusterServers) -> str:
    """conftest's ``settings``, ``r`` and workers follow this cluster."""
    return cluster.url


def node(cluster: RedisClusterServers, port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=10)


def counters(cluster: RedisClusterServers) -> dict[int, dict[str, int]]:
    """Per node (by port): its cluster bus counters, the pub/sub commands it
    ran, and the bytes its clients' connections moved."""
    out: dict[int, dict[str, int]] = {}
    for server in cluster.nodes:
        if server.proc is None:
            continue
        one = node(cluster, server.port)
        info = one.cluster("info")
        stats = one.info("stats")
        commands = one.info("commandstats")
        out[server.port] = {
            **{k: int(info.get(k, 0)) for k in BUS},
            **{f"cmd_{c}": int(commands.get(f"cmdstat_{c}", {}).get("calls", 0))
               for c in ("publish", "spublish", "subscribe", "ssubscribe")},
            "net_in": int(stats["total_net_input_bytes"]),
            "net_out": int(stats["total_net_output_bytes"]),
        }
        one.close()
    return out


def delta(before: dict[int, dict[str, int]], after: dict[int, dict[str, int]]
          ) -> dict[int, dict[str, int]]:
    return {port: {k: v - before[port][k] for k, v in figures.items()}
            for port, figures in after.items() if port in before}


def total(figures: dict[int, dict[str, int]], name: str) -> int:
    return sum(f[name] for f in figures.values())


def bus_settled(figures: dict[int, dict[str, int]]) -> bool:
    """Whether every publish a node sent on the bus has been received."""
    return all(total(figures, f"cluster_stats_messages_{kind}_received")
               >= total(figures, f"cluster_stats_messages_{kind}_sent")
               for kind in ("publish", "publishshard"))


def owner_port(r: Any, key: str) -> int:
    r.nodes_manager.initialize()  # this client may hold an old map
    return int(r.get_node_from_key(key).port)


def stream_all(settings: Any, job_ids: list[str]) -> dict[str, Any]:
    """Each job streamed by the async client (half of them) or the blocking one."""
    seen: dict[str, Any] = {}

    async def main() -> None:
        async with AsyncFleetClient(settings=settings) as c:
            async def one(job_id: str) -> None:
                seen[job_id] = [e async for e in c.stream(job_id, timeout=60)]
            await asyncio.gather(*(one(j) for j in job_ids[::2]))

    def blocking() -> None:
        with FleetClient(settings=settings) as c:
            for job_id in job_ids[1::2]:
                seen[job_id] = list(c.stream(job_id, timeout=60))

    threads = [threading.Thread(target=lambda: asyncio.run(main())),
               threading.Thread(target=blocking)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    return seen


def test_clients_and_gateway_stream_from_shard_channels(
    cluster: RedisClusterServers, settings: Any, client: FleetClient, start_worker: Any,
    gateway: Any, r: Any,
) -> None:
    assert client.keys.sharded
    start_worker("w1@shards")
    before = counters(cluster)
    ids = [client.submit(f"job {i} once upon a time", max_new_tokens=24, temperature=0.0)
           for i in range(4)]
    seen = stream_all(settings, ids)
    http = gateway()
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 12,
            "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    plain = http.post("/v1/completions", json={**body, "stream": False})
    figures = delta(before, counters(cluster))

    for job_id in ids:
        state = client.wait(job_id, timeout=30)
        assert state.status is JobStatus.SUCCEEDED
        assert stream_fault(seen.get(job_id), state) == "", job_id
    assert streamed and streamed == plain.json()["choices"][0]["text"]
    owner = owner_port(r, client.keys.events(ids[0]))
    assert figures[owner]["cmd_ssubscribe"] >= len(ids)  # every stream, on the job's node
    assert figures[owner]["cmd_spublish"] > 0
    assert total(figures, "cmd_publish") == 0  # no classic publish at all


def run_jobs(settings: Any, client: FleetClient, count: int, tokens: int) -> list[str]:
    ids = [client.submit(f"measure {i} the value of a list", max_new_tokens=tokens,
                         temperature=0.0) for i in range(count)]
    seen = stream_all(settings, ids)
    for job_id in ids:
        assert stream_fault(seen.get(job_id), client.wait(job_id, timeout=30)) == "", job_id
    return ids


def test_shard_channels_keep_tokens_off_the_cluster_bus(
    cluster: RedisClusterServers, settings: Any, start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs, tokens = 6, 32
    results: dict[str, dict[int, dict[str, int]]] = {}
    for mode in ("classic", "sharded"):
        if mode == "classic":  # the fleet as it was: classic pub/sub on the cluster
            monkeypatch.setattr(Keys, "for_url", classmethod(lambda cls, ns, url: cls(ns)))
        else:
            monkeypatch.undo()
        name = f"w-{mode}@bus"
        run_settings = settings.model_copy(update={"namespace": f"{settings.namespace}{mode}"})
        with FleetClient(settings=run_settings) as client:
            assert client.keys.sharded is (mode == "sharded")
            # Every token its own event, in both runs alike.
            start_worker(name, namespace=run_settings.namespace, coalesce_ms=0)
            # The last run's publishes still crossing the bus would count in this one.
            wait_until(lambda: bus_settled(counters(cluster)), timeout=10,
                       what="the cluster bus to deliver the last run's publishes")
            before = counters(cluster)
            run_jobs(run_settings, client, jobs, tokens)
            results[mode] = delta(before, counters(cluster))

    print(f"\ncluster bus and client traffic over {jobs} jobs of {tokens} tokens streamed "
          f"(per node: port, publish sent/received, publishshard sent/received, "
          f"net in/out bytes):")
    for mode, figures in results.items():
        sent = total(figures, "cluster_stats_messages_publish_sent")
        shard_sent = total(figures, "cluster_stats_messages_publishshard_sent")
        published = total(figures, "cmd_publish") + total(figures, "cmd_spublish")
        print(f"  {mode}: {published} events published; bus messages sent: publish {sent}, "
              f"publishshard {shard_sent} "
              f"(~{(sent + shard_sent) * BUS_HEADER_BYTES / 1024:.0f} KiB of headers alone)")
        for port, f in sorted(figures.items()):
            print(f"    {port}: publish {f['cluster_stats_messages_publish_sent']}/"
                  f"{f['cluster_stats_messages_publish_received']}, publishshard "
                  f"{f['cluster_stats_messages_publishshard_sent']}/"
                  f"{f['cluster_stats_messages_publishshard_received']}, net "
                  f"{f['net_in']}/{f['net_out']}")
    classic, sharded = results["classic"], results["sharded"]
    # Classic: every event goes from the publishing node to each of the five others.
    assert total(classic, "cluster_stats_messages_publish_sent") >= jobs * 5
    # Sharded: no publish message; an event goes to its shard's replica alone.
    assert total(sharded, "cluster_stats_messages_publish_sent") == 0
    assert total(sharded, "cluster_stats_messages_publish_received") == 0
    shard_sent = [p for p, f in sharded.items() if f["cluster_stats_messages_publishshard_sent"]]
    assert len(shard_sent) == 1  # the queue's master, to its replica


def streams_through(settings: Any, client: FleetClient, job_ids: list[str],
                    move: Callable[[], None]) -> None:
    """Stream the first job with the async client and the second with the
    blocking one; once they are under way, ``move`` the channels' slot to
    another node; once 16 more tokens came after the move, cancel both jobs
    (so they are streaming through the move however fast the machine). Every
    token must reach each stream once."""
    progress = threading.Condition()
    heard = [0]  # tokens the async stream has had
    seen: dict[str, Any] = {}

    async def follow() -> None:
        async with AsyncFleetClient(settings=settings) as c:
            events = []
            async for event in c.stream(job_ids[0], timeout=90):
                events.append(event)
                with progress:
                    heard[0] = event.end
                    progress.notify_all()
            seen[job_ids[0]] = events

    def follow_blocking() -> None:
        with FleetClient(settings=settings) as c:
            seen[job_ids[1]] = list(c.stream(job_ids[1], timeout=90))

    def hear(tokens: int) -> None:
        with progress:
            assert progress.wait_for(lambda: heard[0] >= tokens, 60), f"{heard[0]} tokens"

    threads = [threading.Thread(target=lambda: asyncio.run(follow())),
               threading.Thread(target=follow_blocking)]
    for thread in threads:
        thread.start()
    hear(16)
    move()
    hear(heard[0] + 16)
    for job_id in job_ids:
        client.cancel(job_id, timeout=30)
    for thread in threads:
        thread.join(90)
    for job_id in job_ids:
        state = client.wait(job_id, timeout=60)
        assert state.status is JobStatus.CANCELLED
        assert stream_fault(seen.get(job_id), state) == "", job_id


def ssubscribes(cluster: RedisClusterServers, port: int) -> int:
    stats = node(cluster, port).info("commandstats")
    return int(stats.get("cmdstat_ssubscribe", {}).get("calls", 0))


def long_jobs(client: FleetClient, label: str) -> list[str]:
    # Long enough to be under way through the move on a fast machine too.
    return [client.submit(f"{label} {i} the value of a list", max_new_tokens=200,
                          temperature=0.0) for i in range(2)]


def test_a_stream_through_a_failover_of_its_channels_master_gets_every_token_once(
    cluster: RedisClusterServers, settings: Any, client: FleetClient, start_worker: Any,
    r: Any,
) -> None:
    start_worker("w1@failover")
    job_ids = long_jobs(client, "failover")
    channel = client.keys.events(job_ids[0])
    master = owner_port(r, channel)
    replica = next(s.port for s in cluster.nodes
                   if s.port != master and node(cluster, s.port).info("replication")
                   .get("master_port") == master)

    def fail_over() -> None:
        # A manual failover: the replica takes the master's slots; the old
        # master, a replica now, unsubscribes its shard channels' subscribers.
        node(cluster, replica).cluster("failover")
        wait_until(lambda: owner_port(r, channel) == replica, timeout=30,
                   what="the replica to take over the channel's slot")

    streams_through(settings, client, job_ids, fail_over)
    # Both streams (async, blocking) went on from the new master's shard channel.
    assert ssubscribes(cluster, replica) >= 2


def test_a_stream_through_a_resharding_of_its_channels_slot_gets_every_token_once(
    cluster: RedisClusterServers, settings: Any, client: FleetClient, start_worker: Any,
    r: Any,
) -> None:
    start_worker("w1@reshard")
    job_ids = long_jobs(client, "reshard")
    channel = client.keys.events(job_ids[0])
    slot = int(r.keyslot(channel))
    source = owner_port(r, channel)
    masters = [int(n.port) for n in r.get_primaries()]
    target = next(p for p in masters if p != source)
    ids = {p: node(cluster, p).cluster("myid") for p in masters}

    def reshard() -> None:
        # What `redis-cli --cluster reshard` does for one slot: the target
        # imports it, its keys migrate, then every master learns its new owner
        # (the source unsubscribes the slot's shard channels' subscribers).
        from_node, to_node = node(cluster, source), node(cluster, target)
        to_node.cluster("setslot", slot, "importing", ids[source])
        from_node.cluster("setslot", slot, "migrating", ids[target])
        while batch := from_node.cluster("getkeysinslot", slot, 100):
            from_node.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000,
                                      "KEYS", *batch)
        for port in (target, source, *masters):
            node(cluster, port).cluster("setslot", slot, "node", ids[target])

    streams_through(settings, client, job_ids, reshard)
    assert owner_port(r, channel) == target
    assert ssubscribes(cluster, target) >= 2
