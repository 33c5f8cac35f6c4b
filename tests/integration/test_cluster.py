"""The fleet on a Redis Cluster: three masters on free ports, made with
``redis-cli --cluster create``, the clients, workers and ``status`` given
``redis+cluster://`` and any one node.

- jobs of two queues whose keys live on different masters, a Celery worker per
  queue, one of them killed with SIGKILL mid-run: every job succeeds once, with
  gap-free streams, one end each and the undisturbed texts;
- the client's calls (submit, wait, stream, cancel, idempotency keys, the fleet
  status) and a malformed entry, which goes to its queue's dead letters;
- the gateway's models, plain and streamed completions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.wire.serialization import loads

from gateway_server import gateway  # noqa: F401  (a fixture)
from helpers import (ChannelTally, RedisClusterServers, direct_greedy, follow_all, stream_fault,
                     wait_until)
from placed_kill import frozen_mid_job

pytestmark = [pytest.mark.timeout(300)]

# Two queues whose slots the three masters' even split puts on different nodes.
QUEUES = ("default", "other")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """This module's Redis is a cluster of three masters, whatever ``--redis`` says:
    conftest's ``settings`` and ``r`` (a cluster client here) follow it."""
    servers = RedisClusterServers(masters=3)
    yield servers.url
    servers.close()


def node_of(r: Any, key: str) -> str:
    return str(r.get_node_from_key(key).name)


def test_the_queues_live_on_different_masters(r: Any, settings: Any) -> None:
    keys = Keys(settings.namespace)
    assert node_of(r, keys.queue(QUEUES[0])) != node_of(r, keys.queue(QUEUES[1]))
    job_id = "default:0123456789abcdef0123456789abcdef"
    # A script touches a queue and its jobs together: one slot.
    slots = {r.keyslot(k) for k in (keys.queue("default"), keys.queue("default:high"),
                                   keys.job(job_id), keys.out(job_id), keys.events(job_id),
                                   keys.ends(job_id), keys.dlq("default"),
                                   keys.backlog("default"), keys.queue_workers("default"),
                                   keys.idempotency("default", "order-1"))}
    assert len(slots) == 1


@pytest.mark.slow
def test_kill_9_on_a_cluster_with_two_queues_loses_nothing_and_runs_nothing_twice(
    settings: Any, client: FleetClient, celery_workers: Any, r: Any, loaded_tiny: Any,
) -> None:
    keys = Keys(settings.namespace)
    jobs = {q: [(f"{q} job {i} the value of a list", 40 + (i * 7) % 40) for i in range(40)]
            for q in QUEUES}
    ids = {q: [client.submit(p, max_new_tokens=n, temperature=0.0, model=q, require_worker=False)
               for p, n in jobs[q]] for q in QUEUES}
    every = [j for q in QUEUES for j in ids[q]]
    assert all(j.startswith(f"{q}:") for q in QUEUES for j in ids[q])
    tally = ChannelTally(settings.redis_url, keys, every)
    consumers, seen = follow_all(settings, every)
    slow = {"TOKENFLEET_MAX_BATCH": "4", "TOKENFLEET_CLAIM_IDLE_S": "2"}
    celery_workers("cpu@other", TOKENFLEET_QUEUE="other", **slow)
    first = celery_workers("cpu@first", TOKENFLEET_QUEUE="default", **slow)

    with frozen_mid_job(first.proc, r, keys, "cpu@first", ids["default"]) as in_flight:
        first.kill()  # SIGKILL: its pending entries stay with cpu@first
    celery_workers("cpu@second", TOKENFLEET_QUEUE="default", **slow)
    states = {q: [client.wait(j, timeout=180) for j in ids[q]] for q in QUEUES}
    consumers.join(timeout=60)
    tally.wait_ended(every, timeout=30)
    tally.close()

    for q in QUEUES:
        assert [s.status for s in states[q]] == [JobStatus.SUCCEEDED] * 40, q
        assert [s.text for s in states[q]] == direct_greedy(loaded_tiny, jobs[q]), q
    every_state = [s for q in QUEUES for s in states[q]]
    assert all(s.attempts == 2 for j, s in zip(ids["default"], states["default"])
               if j in in_flight), in_flight
    assert all(s.attempts == 1 for s in states["other"])  # the other queue's worker never noticed
    assert tally.ends_not_once(every) == {}  # each end published once
    assert tally.duplicated == 0
    assert sum(tally.tokens.values()) == sum(len(s.token_ids) for s in every_state)
    for state in every_state:
        assert stream_fault(seen[state.id], state) == "", state.id


@pytest.mark.slow
def test_the_client_and_status_on_a_cluster(
    settings: Any, client: FleetClient, start_worker: Any, r: Any,
) -> None:
    from tokenfleet.client.fleet import fleet_status

    keys = Keys(settings.namespace)
    start_worker("w1@cluster")
    job_id = client.submit("Once upon a time", max_new_tokens=8, temperature=0.0)
    events = list(client.stream(job_id, timeout=60))
    state = client.wait(job_id, timeout=60)
    assert state.status is JobStatus.SUCCEEDED
    assert "".join(e.text for e in events if e.text) == state.text

    again = client.submit("Once upon a time", max_new_tokens=8, idempotency_key="order-1")
    assert client.submit("Once upon a time", max_new_tokens=8, idempotency_key="order-1") == again
    assert client.wait(again, timeout=60).status is JobStatus.SUCCEEDED

    queued = client.submit("never runs", max_new_tokens=4, model="other", require_worker=False)
    assert client.cancel(queued, timeout=10)
    assert client.status(queued).status is JobStatus.CANCELLED
    assert r.xlen(keys.queue("other")) == 0

    # An entry no job comes from, and one whose id is of another queue.
    r.xadd(keys.queue("default"), {"data": b"{not json"})
    r.xadd(keys.queue("default"), {"data": b'{"job_id": "other:abc", "request": {"prompt": "x"},'
                                           b' "created_at": 0}'})
    wait_until(lambda: r.xlen(keys.dlq("default")) >= 2, timeout=30, what="two dead letters")
    reasons = [loads(f[b"data"])["reason"] for _, f in r.xrange(keys.dlq("default"))]
    assert "Invalid JSON" in reasons[0] and "is not of queue 'default'" in reasons[1]
    after = client.submit("still serving", max_new_tokens=4)
    assert client.wait(after, timeout=60).status is JobStatus.SUCCEEDED

    report = fleet_status(client)
    (default,) = [q for q in report["queues"] if q["queue"] == "default"]
    assert default["workers"] == 1 and default["dead_letters"] == 2 and default["depth"] == 0
    assert [w["name"] for w in report["workers"]] == ["w1@cluster"]


@pytest.mark.slow
def test_the_gateway_on_a_cluster(gateway: Any, start_worker: Any) -> None:
    start_worker("w1@gateway")
    http = gateway()
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["default"]
    plain = http.post("/v1/completions", json={"model": "default", "prompt": "Once upon a time",
                                               "max_tokens": 8, "temperature": 0})
    assert plain.status_code == 200, plain.text
    text = plain.json()["choices"][0]["text"]
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [line.removeprefix("data: ") for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(loads(c)["choices"][0]["text"] for c in chunks if loads(c)["choices"])
    assert streamed == text and text
