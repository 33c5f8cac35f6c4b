"""Placement by prefix (``TOKENFLEET_AFFINITY``), on a real redis-server with two
in-process workers of the tiny model:

- a prompt's jobs go to the worker that ran its prefix first: each one waits in
  that worker's own stream (its record names the owner) and runs there;
- a job placed on a worker that takes nothing is stolen by the other once it
  waited ``TOKENFLEET_AFFINITY_STEAL_MS``, and ends whole, once;
- a worker that leaves with jobs waiting in its own stream: the other takes them
  over at once, and forgets it once its streams are empty;
- a queued job in an owned stream cancels, and leaves the stream;
- the queue's depth (``max_queue``) counts the jobs waiting in owned streams;
- a job handed back by a draining owner goes to the shared stream.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.client.protocol import pick_partition
from tokenfleet.shared.wire.errors import QueueFull
from tokenfleet.shared.wire.keys import Keys, level_owner, owner_tag
from tokenfleet.shared.wire.prefixes import prefix_keys
from tokenfleet.shared.wire.schemas import GenerationRequest, JobStatus

from helpers import wait_until

pytestmark = [pytest.mark.timeout(180)]

# Two system prompts of ~600 characters: their jobs share the keys of 128 to 512.
SYSTEM = {name: (f"You are the {name} assistant. " * 30)[:600] for name in ("red", "blue")}


def prompt(system: str, i: int) -> str:
    return f"{SYSTEM[system]}\nUser {i}: say something.\nAssistant:"


@pytest.fixture
def placed(settings: Any) -> Iterator[FleetClient]:
    with FleetClient(settings=settings.model_copy(update={"affinity": True})) as c:
        yield c


@pytest.fixture
def two(start_worker: Callable[..., Any]) -> tuple[Any, Any]:
    return (start_worker("w1@test", affinity=True, affinity_steal_ms=300),
            start_worker("w2@test", affinity=True, affinity_steal_ms=300))


def owner_of(r: redis.Redis, keys: Keys, job_id: str) -> str | None:
    raw = r.hget(keys.job(job_id), "owner")
    return raw.decode() if raw else None


def held(r: redis.Redis, keys: Keys, worker: Any) -> set[str]:
    return {k.decode() for k in r.zrange(keys.held(worker.partitions[0], owner_tag(worker.name)),
                                         0, -1)}


def hold(r: redis.Redis, keys: Keys, worker: Any, text: str) -> str:
    """Advertise ``text``'s prefixes as held by ``worker``, in the partition its
    jobs go to; that partition."""
    request = GenerationRequest(prompt=text)
    prefixes = prefix_keys(request)
    part = pick_partition(request, len(worker.partitions), 0, prefixes)
    r.zadd(keys.held(part, owner_tag(worker.name)), {k.key: time.time() for k in prefixes})
    return part


def placed_on_a_paused_owner(placed: FleetClient, two: tuple[Any, Any], system: str,
                             n: int) -> tuple[Any, Any, list[str]]:
    """The worker that ran ``system``'s prompt first (paused since), the other,
    and ``n`` jobs of that prompt submitted after: placed on the first."""
    first = placed.submit(prompt(system, 0), max_new_tokens=4, temperature=0.0)
    runner = placed.wait(first, timeout=60).worker
    owner, other = (two if two[0].name == runner else two[::-1])
    owner.paused.set()
    jobs = [placed.submit(prompt(system, i), max_new_tokens=4, temperature=0.0)
            for i in range(1, n + 1)]
    return owner, other, jobs


def test_prefix_keys_name_the_shared_beginning() -> None:
    a = prefix_keys(GenerationRequest(prompt=prompt("red", 1)))
    b = prefix_keys(GenerationRequest(prompt=prompt("red", 2)))
    c = prefix_keys(GenerationRequest(prompt=prompt("blue", 1)))
    assert [k.length for k in a] == [128, 256, 512]
    assert a == b  # the user turns differ past 600 characters
    assert not {k.key for k in a} & {k.key for k in c}
    chat = [{"role": "system", "content": SYSTEM["red"]}, {"role": "user", "content": "hi"}]
    one = prefix_keys(GenerationRequest(messages=chat))
    two = prefix_keys(GenerationRequest(messages=[*chat, {"role": "assistant", "content": "yo"},
                                                  {"role": "user", "content": "more"}]))
    assert one and one[0] in two  # a conversation's earlier turns match the worker that ran them
    assert prefix_keys(GenerationRequest(prompt="short")) == []
    keyed = prefix_keys(GenerationRequest(prompt="short", prompt_cache_key="user-42"))
    assert len(keyed) == 1 and keyed[0].length == len("short")


def test_both_routes_carry_prompt_cache_key_to_the_job_and_its_prefix_keys(
        settings: Any) -> None:
    from tokenfleet.openai.chat import ChatRequest
    from tokenfleet.openai.completions import CompletionRequest
    from tokenfleet.openai.translate import chat_job, completion_job

    completion = completion_job(CompletionRequest(prompt="hi", prompt_cache_key="user-42"),
                                settings)
    chat = chat_job(ChatRequest(messages=[{"role": "user", "content": "hi"}],
                                prompt_cache_key="user-42"), settings)
    for job in (completion, chat):
        assert job.prompt_cache_key == "user-42"
        assert len(prefix_keys(job)) == 1  # the key alone: "hi" is too short to match on
    # Two requests under one key share it, whatever their text.
    assert prefix_keys(completion)[0].key == prefix_keys(completion_job(CompletionRequest(
        prompt="another text", prompt_cache_key="user-42"), settings))[0].key


def test_jobs_of_a_prefix_run_on_the_worker_that_holds_it(
        placed: FleetClient, two: tuple[Any, Any], r: redis.Redis) -> None:
    keys = placed.keys
    first = placed.submit(prompt("red", 0), max_new_tokens=4, temperature=0.0)
    runner = placed.wait(first, timeout=60).worker
    worker = next(w for w in two if w.name == runner)
    assert {k.key for k in prefix_keys(GenerationRequest(prompt=prompt("red", 0)))} <= held(
        r, keys, worker)
    jobs = [placed.submit(prompt("red", i), max_new_tokens=4, temperature=0.0)
            for i in range(1, 9)]
    states = [placed.wait(j, timeout=60) for j in jobs]
    assert all(s.status is JobStatus.SUCCEEDED for s in states)
    assert {s.worker for s in states} == {runner}
    assert {owner_of(r, keys, j) for j in jobs} == {owner_tag(runner)}


def test_owners_that_hold_a_prefix_alike_split_the_prefixes_between_them(
        placed: FleetClient, two: tuple[Any, Any], r: redis.Redis) -> None:
    """Both hold every prefix and neither has work waiting (a low arrival rate):
    each prefix's jobs go to one of them, the highest hash of prefix and owner,
    so their caches split the prefixes rather than the first owner listed
    taking every job."""
    keys, tags = placed.keys, [owner_tag(w.name) for w in two]
    texts = [f"{(f'You are the assistant of team {k}. ' * 30)[:600]}\nUser: hi.\nAssistant:"
             for k in range(8)]
    for text in texts:
        for worker in two:
            hold(r, keys, worker, text)
    owners = []
    for text in texts * 2:
        job = placed.submit(text, max_new_tokens=2, temperature=0.0)
        assert placed.wait(job, timeout=60).status is JobStatus.SUCCEEDED  # none left waiting
        owners.append(owner_of(r, keys, job))
    longest = [prefix_keys(GenerationRequest(prompt=t))[-1].key for t in texts]
    assert owners[:8] == [max(tags, key=lambda tag: hashlib.sha1(f"{key}{tag}".encode())
                              .hexdigest()) for key in longest]
    assert owners[8:] == owners[:8]  # a prefix's jobs keep to one owner
    assert set(owners) == set(tags)


def test_a_job_waiting_behind_a_worker_that_takes_nothing_is_stolen(
        placed: FleetClient, two: tuple[Any, Any], r: redis.Redis) -> None:
    keys = placed.keys
    # live, heartbeating, reading nothing: a worker whose slots are full
    owner, other, jobs = placed_on_a_paused_owner(placed, two, "blue", 4)
    assert {owner_of(r, keys, j) for j in jobs} == {owner_tag(owner.name)}
    states = [placed.wait(j, timeout=60) for j in jobs]
    assert all(s.status is JobStatus.SUCCEEDED for s in states)
    assert {s.worker for s in states} == {other.name}
    assert all(s.attempts == 1 for s in states)
    # Taken once it waited the steal time: not before.
    assert all(s.started_at is not None and s.created_at is not None
               and s.started_at - s.created_at >= 0.3 for s in states)


def test_a_loaded_owner_leaves_the_rest_of_its_prefixs_jobs_to_an_idle_peer(
        placed: FleetClient, two: tuple[Any, Any], r: redis.Redis) -> None:
    """Production-stack's score: an owner that does not hold the prefix scores
    its load alone. Once the holder's load outweighs what its cache saves, its
    prefix's jobs go to the shared stream, where the idle peer takes them at
    once, rather than waiting in the holder's stream for the steal time."""
    keys = placed.keys
    owner, other, jobs = placed_on_a_paused_owner(placed, two, "red", 16)  # 16 slots each
    owners = [owner_of(r, keys, j) for j in jobs]
    placed_count = owners.count(owner_tag(owner.name))
    assert 8 <= placed_count < 16
    assert owners[:placed_count] == [owner_tag(owner.name)] * placed_count
    # The first of the rest to the shared stream; once the peer has started one,
    # it holds the prefix too, and the next may be placed on it.
    assert owners[placed_count] is None
    assert set(owners[placed_count:]) <= {None, owner_tag(other.name)}
    states = [placed.wait(j, timeout=60) for j in jobs]
    assert all(s.status is JobStatus.SUCCEEDED for s in states)
    assert {s.worker for s in states[:placed_count]} == {other.name}  # stolen from the owner
    # The rest did not wait for the steal time (a blocking read the owner had in
    # flight as it was paused may take the first of them: it runs there).
    assert all(s.started_at is not None and s.created_at is not None
               and s.started_at - s.created_at < 0.3 for s in states[placed_count:])


def test_a_departed_owners_waiting_jobs_are_taken_over(
        placed: FleetClient, two: tuple[Any, Any], r: redis.Redis) -> None:
    keys = placed.keys
    owner, other, jobs = placed_on_a_paused_owner(placed, two, "red", 3)
    owner.stop(grace_s=0)  # it leaves: off the served set and the owners
    states = [placed.wait(j, timeout=60) for j in jobs]
    assert all(s.status is JobStatus.SUCCEEDED and s.worker == other.name for s in states)
    part = other.partitions[0]
    tag = owner_tag(owner.name)
    assert not r.hexists(keys.owners(part), tag)  # no job is placed on it now
    wait_until(lambda: not any(level_owner(m.decode()) == tag
                               for m in r.smembers(keys.owned_levels(part))),
               timeout=30, what="the departed owner's empty streams to be forgotten")
    assert not r.exists(keys.held(part, tag))


def test_a_queued_job_in_an_owned_stream_cancels(
        placed: FleetClient, two: tuple[Any, Any], r: redis.Redis) -> None:
    keys = placed.keys
    for w in two:
        w.paused.set()
    # Held by hand: neither worker ran this prefix, so the job would go shared.
    w1 = two[0]
    part = hold(r, keys, w1, prompt("red", 0))
    job = placed.submit(prompt("red", 5), max_new_tokens=4)
    tag = owner_of(r, keys, job)
    assert tag == owner_tag(w1.name)
    stream = keys.queue(f"{part}:normal:default:{tag}")
    assert r.xlen(stream) == 1
    assert placed.cancel(job)
    assert placed.status(job).status is JobStatus.CANCELLED
    assert r.xlen(stream) == 0


@pytest.mark.one_partition("TOKENFLEET_MAX_QUEUE caps each partition's jobs")
def test_the_depth_counts_the_owned_streams(
        settings: Any, start_worker: Callable[..., Any], r: redis.Redis) -> None:
    worker = start_worker("w1@test", affinity=True, max_queue=3)
    worker.paused.set()
    keys = Keys(settings.namespace)
    hold(r, keys, worker, prompt("red", 0))
    with FleetClient(settings=settings.model_copy(update={"affinity": True,
                                                          "max_queue": 3})) as c:
        jobs = [c.submit(prompt("red", i), max_new_tokens=4) for i in range(3)]
        assert {owner_of(r, keys, j) for j in jobs} == {owner_tag(worker.name)}
        with pytest.raises(QueueFull):
            c.submit("a job for the shared stream", max_new_tokens=4)


def test_an_owners_entry_no_worker_wrote_breaks_neither_submits_nor_workers(
        placed: FleetClient, two: tuple[Any, Any], r: redis.Redis) -> None:
    keys = placed.keys
    part = two[0].partitions[0]
    r.hset(keys.owners(part), mapping={"w0123456789": b"not json",
                                       "wabcdefabcd": b'{"worker": 5, "slots": "many"}',
                                       "wffffffffff": b"[]"})
    for tag in ("w0123456789", "wabcdefabcd", "wffffffffff"):
        r.zadd(keys.held(part, tag), {k.key: time.time() for k in prefix_keys(
            GenerationRequest(prompt=prompt("red", 0)))})
    jobs = [placed.submit(prompt("red", i), max_new_tokens=4) for i in range(4)]
    assert all(placed.wait(j, timeout=60).status is JobStatus.SUCCEEDED for j in jobs)
    assert not {owner_of(r, keys, j) for j in jobs} & {"w0123456789", "wabcdefabcd",
                                                        "wffffffffff"}


def test_a_stopping_owner_gives_its_waiting_jobs_to_the_shared_stream(
        placed: FleetClient, two: tuple[Any, Any], r: redis.Redis) -> None:
    """The last worker of a pool scaled to zero: nobody would read its own
    stream, and a scaler counts the shared ones. Its waiting jobs move there,
    whole, cancel where they are now, and run on the next worker."""
    keys = placed.keys
    owner, other, jobs = placed_on_a_paused_owner(placed, two, "red", 3)
    other.stop(grace_s=0)
    part = owner.partitions[0]
    own = keys.queue(f"{part}:normal:default:{owner_tag(owner.name)}")
    assert r.xlen(own) == 3
    owner.stop(grace_s=0)
    assert r.xlen(own) == 0 and r.xlen(keys.queue(part)) == 3
    assert not r.hexists(keys.owners(part), owner_tag(owner.name))
    assert {owner_of(r, keys, j) for j in jobs} == {None}
    assert all(placed.status(j).status is JobStatus.QUEUED for j in jobs)
    assert placed.cancel(jobs[0]) and r.xlen(keys.queue(part)) == 2
    assert int(r.get(keys.backlog(part)) or 0) > 0  # the two left still count


def test_status_the_backlog_gauge_and_repair_see_the_jobs_in_own_streams(
        settings: Any, r: redis.Redis, pytestconfig: pytest.Config) -> None:
    """A job placed on a worker that then dies (kill -9: it moved nothing):
    ``tokenfleet status`` and the gauge a pool scales on count it, and once no
    worker serves the queue, a repair ends it at its deadline."""
    from prometheus_client import generate_latest

    from tokenfleet.client.fleet import fleet_status, repair_fleet
    from tokenfleet.exporter.backlog import registry
    from tokenfleet.shared.redis.clock import redis_now

    queue = settings.queue
    with FleetClient(settings=settings.model_copy(update={"affinity": True})) as c:
        keys = c.keys
        request = GenerationRequest(prompt=prompt("red", 0), model=queue)
        part = pick_partition(request, pytestconfig.getoption("--partitions"), 0,
                              prefix_keys(request))
        ghost, tag = "ghost@test", owner_tag("ghost@test")
        # Live for a minute, as its heartbeat would say.
        r.zadd(keys.queue_workers(part), {ghost: redis_now(r) + 60})
        r.hset(keys.owners(part), tag, '{"worker": "ghost@test", "slots": 4}')
        r.zadd(keys.held(part, tag), {k.key: time.time() for k in prefix_keys(request)})
        job = c.submit(prompt("red", 1), max_new_tokens=4, deadline_s=0.5, model=queue,
                       require_worker=False)
        assert owner_of(r, keys, job) == tag
        row = next(q for q in fleet_status(c)["queues"] if q["queue"] == queue)
        assert row["depth"] == 1, row
        text = generate_latest(registry(r, keys)).decode()
        assert f'tokenfleet_queue_backlog{{priority="normal",queue="{queue}"}} 1.0' in text
        r.zrem(keys.queue_workers(part), ghost)  # it died: nobody serves the queue
        wait_until(lambda: c.status(job).status is JobStatus.EXPIRED, timeout=10,
                   what="the deadline to pass")
        assert repair_fleet(c).expired == 1
        assert r.hget(keys.job(job), "status") == b"expired"
        assert r.xlen(keys.queue(f"{part}:normal:default:{tag}")) == 0
