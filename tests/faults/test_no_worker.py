"""Waiting with nobody to wait for: a queue no live worker serves, deadlines of
jobs queued ahead of the workers, queues nobody uses, and a Redis that was never
reachable (wrong port, wrong password). Each fails fast and clearly, or ends."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from redis.exceptions import AuthenticationError, ConnectionError

from tokenfleet import (
    AsyncFleetClient,
    FleetClient,
    JobState,
    NoWorker,
    RedisAuthFailed,
    RedisUnavailable,
)
from tokenfleet.client.fleet import Repaired, fleet_status, repair_fleet
from tokenfleet.shared.wire.keys import Keys, job_model
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus

from helpers import free_port, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

# A timeout the test's own (pytest's) comes long before: a call given it that
# returns woke on the event it waits for, not at its timeout.
PAST_THE_TEST_S = 600


def test_a_submit_to_a_queue_no_live_worker_serves_is_refused_at_once(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any]
) -> None:
    with pytest.raises(NoWorker, match=r"queues served now: none"):
        client.submit("hi")  # nobody at all
    start_worker(name="w1@test")
    start_worker(name="w2@test", queue="fast")
    started = time.monotonic()
    with pytest.raises(NoWorker) as info:
        client.submit("hi", model="defualt")  # a typo of the model name
    seconds = time.monotonic() - started
    message = str(info.value)
    assert "'defualt'" in message and "queues served now: 'default', 'fast'" in message
    assert "\n" not in message and "require_worker=False" in message
    assert info.value.served == ["default", "fast"]
    # Nothing was written for the refused job: no stream, no record, no backlog.
    keys = Keys(settings.namespace)
    assert not r.exists(keys.queue("defualt"), keys.backlog("defualt"))
    assert list(r.scan_iter(match=keys.job("*"))) == []
    # The served queues take the same call.
    job_id = client.submit("hi", model="fast", max_new_tokens=2)
    assert client.wait(job_id, timeout=30).status is JobStatus.SUCCEEDED
    report.update(refused_in_s=round(seconds, 4), served_listed=len(info.value.served))


async def test_the_async_client_refuses_an_unserved_queue_too(settings: Any) -> None:
    async with AsyncFleetClient(settings=settings) as c:
        with pytest.raises(NoWorker, match="no live worker serves queue 'default'"):
            await c.submit("hi")
        assert await c.submit("hi", require_worker=False)


def test_queueing_ahead_of_the_workers_is_an_explicit_opt_in(
    settings: Any, start_worker: Any
) -> None:
    with FleetClient(settings=settings.model_copy(update={"require_worker": False})) as ahead:
        job_id = ahead.submit("hi", max_new_tokens=2)  # TOKENFLEET_REQUIRE_WORKER=0
        with pytest.raises(NoWorker):
            ahead.submit("hi", require_worker=True)  # the argument wins over the setting
        assert ahead.status(job_id).status is JobStatus.QUEUED
        start_worker()
        assert ahead.wait(job_id, timeout=30).status is JobStatus.SUCCEEDED


def _queued_ahead(client: FleetClient, deadline_s: float = 1.0, model: str = "default") -> str:
    job_id = client.submit("nobody will run this", max_new_tokens=4, deadline_s=deadline_s,
                           model=model, require_worker=False)
    assert client.status(job_id).status is JobStatus.QUEUED
    return job_id


def _assert_expired_and_gone(state: JobState, r: redis.Redis, settings: Any,
                             model: str = "default") -> None:
    """The job reads expired; the read wrote nothing (its record still says
    queued), and a repair (no worker serves the queue) ends it for good."""
    keys = Keys(settings.namespace)
    assert state.status is JobStatus.EXPIRED and state.finish_reason is FinishReason.DEADLINE
    assert state.error == "deadline passed before the job started"
    assert r.hget(keys.job(state.id), "status") == b"queued"
    with FleetClient(settings=settings) as repairer:
        repair_fleet(repairer)
    assert r.hget(keys.job(state.id), "status") == b"expired"
    part = job_model(state.id)  # the queue, or the job's partition of it
    assert r.xlen(keys.queue(part)) == 0  # off the queue
    assert int(r.get(keys.backlog(part)) or 0) == 0  # out of the backlog


def test_wait_reports_expired_at_the_deadline_with_no_worker_alive(
    client: FleetClient, r: redis.Redis, settings: Any, report: dict[str, Any]
) -> None:
    job_id = _queued_ahead(client)
    deadline_at = client.status(job_id).deadline_at
    assert deadline_at is not None
    state = client.wait(job_id, timeout=PAST_THE_TEST_S)  # wakes at the deadline
    late = time.time() - deadline_at
    _assert_expired_and_gone(state, r, settings)
    assert late >= 0, late  # not before it
    report.update(wait_returned_after_deadline_s=round(late, 3))


def test_stream_ends_at_the_deadline_with_no_worker_alive(
    client: FleetClient, r: redis.Redis, settings: Any, report: dict[str, Any]
) -> None:
    job_id = _queued_ahead(client)
    deadline_at = client.status(job_id).deadline_at
    assert deadline_at is not None
    assert list(client.stream(job_id, timeout=PAST_THE_TEST_S)) == []  # ends at the deadline
    late = time.time() - deadline_at
    _assert_expired_and_gone(client.status(job_id), r, settings)
    assert late >= 0, late  # not before it
    report.update(stream_ended_after_deadline_s=round(late, 3))


def test_status_reports_expired_once_the_deadline_passes(
    client: FleetClient, r: redis.Redis, settings: Any, report: dict[str, Any]
) -> None:
    job_id = _queued_ahead(client)
    state = wait_until(lambda: (s := client.status(job_id)).status.is_terminal and s,
                       timeout=60, what="the job to expire")
    assert state.deadline_at is not None
    late = time.time() - state.deadline_at
    _assert_expired_and_gone(state, r, settings)
    assert late >= 0, late  # not before its deadline
    # Another reader now sees the end too, from the record and the job's token log.
    with FleetClient(settings=settings) as other:
        assert other.wait(job_id, timeout=1).status is JobStatus.EXPIRED
        assert list(other.stream(job_id, timeout=1)) == []
    report.update(status_expired_after_deadline_s=round(late, 3))


async def test_the_async_wait_and_stream_report_expired_at_the_deadline(
    settings: Any, r: redis.Redis
) -> None:
    async with AsyncFleetClient(settings=settings) as c:
        waited = await c.submit("x", deadline_s=1.0, require_worker=False)
        streamed = await c.submit("y", deadline_s=1.0, require_worker=False)
        state = await c.wait(waited, timeout=PAST_THE_TEST_S)  # wakes at the deadline
        # Collected first: pytest's rewriting of an assert around an async
        # comprehension leaves the generator unclosed until the loop ends.
        events = [e async for e in c.stream(streamed, timeout=PAST_THE_TEST_S)]
        assert events == []
        _assert_expired_and_gone(state, r, settings)
        assert (await c.status(streamed)).status is JobStatus.EXPIRED


def test_a_worker_that_comes_after_the_deadline_never_runs_the_expired_job(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    """The job reads expired at once; the worker that comes later ends it without running it."""
    job_id = _queued_ahead(client, deadline_s=0.2)
    assert client.wait(job_id, timeout=5).status is JobStatus.EXPIRED
    worker = start_worker()
    after = client.submit("after", max_new_tokens=2)
    assert client.wait(after, timeout=30).status is JobStatus.SUCCEEDED
    assert client.status(job_id).status is JobStatus.EXPIRED
    assert worker.engine.stats.jobs == {"succeeded": 1}


def test_a_job_that_reads_expired_is_not_cancelled_afterwards(
    client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    job_id = _queued_ahead(client, deadline_s=0.2)
    assert client.wait(job_id, timeout=5).status is JobStatus.EXPIRED
    assert client.cancel(job_id) is False  # nothing to cancel: it can no longer start
    _assert_expired_and_gone(client.status(job_id), r, settings)


def test_a_queue_nobody_uses_leaves_the_fleet_status(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any]
) -> None:
    keys = Keys(settings.namespace)
    start_worker()
    job_id = _queued_ahead(client, deadline_s=0.3, model="defualt")
    shown = {q["queue"]: q for q in fleet_status(client)["queues"]}
    # While a job waits on it, the unserved queue shows, marked as such.
    assert shown["defualt"]["depth"] == 1 and shown["defualt"]["unserved"]
    assert client.wait(job_id, timeout=5).status is JobStatus.EXPIRED
    # A read writes nothing: the entry waits until a repair ends it and forgets the queue.
    assert {q["queue"]: q for q in fleet_status(client)["queues"]}["defualt"]["depth"] == 1
    assert repair_fleet(client) == Repaired(expired=1, forgotten=["defualt"])
    shown = {q["queue"]: q for q in fleet_status(client)["queues"]}
    assert "defualt" not in shown
    assert shown["default"]["workers"] == 1  # a served queue shows, empty or not
    # No worker ever served it: its stream and backlog counter are gone too.
    assert not r.exists(*(keys.queue(f"defualt{p}") for p in ("", ":high", ":low")),
                        keys.backlog("defualt"), keys.queue_workers("defualt"))
    # And a later submit to it (queued ahead) makes it again, counted from zero.
    again = _queued_ahead(client, deadline_s=30, model="defualt")
    shown = {q["queue"]: q for q in fleet_status(client)["queues"]}
    assert shown["defualt"]["depth"] == 1
    assert int(r.get(keys.backlog("defualt")) or 0) > 0
    assert client.cancel(again) is True
    report.update(unused_queue_shown_after_expiry=False, keys_left=0)


def test_an_empty_queue_whose_workers_left_is_hidden_but_keeps_its_group(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    keys = Keys(settings.namespace)
    worker = start_worker(queue="gone")
    job_id = client.submit("hi", model="gone", max_new_tokens=2)
    assert client.wait(job_id, timeout=30).status is JobStatus.SUCCEEDED
    worker.stop(grace_s=0)  # a warm shutdown takes it off the served list
    assert "gone" not in {q["queue"] for q in fleet_status(client)["queues"]}
    # Its consumer group (a worker's or a KEDA scaler's read position) stays.
    assert r.xinfo_groups(keys.queue("gone"))


# -- a Redis that was never reachable ----------------------------------------------


# On a cluster, a user and a kill go to every node: a client reads the slot map
# from any of them, and its commands go to all.
def every_node(r: redis.Redis) -> dict[str, Any]:
    return {"target_nodes": r.ALL_NODES} if hasattr(r, "ALL_NODES") else {}  # type: ignore[attr-defined]


def as_user(redis_url: str, user: str, password: str) -> str:
    """The tests' Redis URL (one server or a cluster's node) with credentials."""
    scheme, rest = redis_url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


def refused_logins(r: redis.Redis, user: str) -> int:
    """How many times Redis refused ``user``'s credentials (its ACL log, every node
    of a cluster): one per connection attempt, so a retry shows as another."""
    replies = r.execute_command("ACL", "LOG", **every_node(r))
    logs = replies.values() if isinstance(replies, dict) else [replies]
    refused = 0
    for log in logs:
        for entry in log:
            entry = {(k.decode() if isinstance(k, bytes) else k):
                     (v.decode() if isinstance(v, bytes) else v) for k, v in entry.items()}
            if entry["reason"] == "auth" and entry["username"] == user:
                refused += int(entry["count"])
    return refused


@pytest.fixture
def acl_user(r: redis.Redis) -> Iterator[str]:
    name = f"u{uuid.uuid4().hex[:8]}"
    r.execute_command("ACL", "SETUSER", name, "on", ">right-password", "~*", "&*", "+@all",
                      **every_node(r))
    yield name
    r.execute_command("ACL", "DELUSER", name, **every_node(r))


def test_a_wrong_password_fails_at_once_and_is_never_retried(
    redis_url: str, acl_user: str, settings: Any, r: redis.Redis, report: dict[str, Any]
) -> None:
    url = as_user(redis_url, acl_user, "wrong-password")
    made: list[FleetClient] = []
    started = time.monotonic()
    with pytest.raises(RedisAuthFailed) as info:
        # A cluster client reads the slot map as it is made: refused there.
        made.append(FleetClient(url, settings=settings))
        made[0].submit("hi", require_worker=False)
    seconds = time.monotonic() - started
    assert refused_logins(r, acl_user) == 1  # one attempt: no retry
    for c in made:  # one server: refused again, not retried, once the client has been up
        with pytest.raises(RedisAuthFailed):
            c.status("x")
        assert refused_logins(r, acl_user) == 2
        c.close()
    message = str(info.value)
    assert isinstance(info.value, AuthenticationError)  # what redis-py users catch
    assert "wrong-password" not in message and f"{acl_user}:***@127.0.0.1" in message
    assert "\n" not in message
    # The right password works through the same code.
    with FleetClient(as_user(redis_url, acl_user, "right-password"), settings=settings) as c:
        assert c.submit("hi", require_worker=False)
    report.update(auth_error_after_s=round(seconds, 3))


def test_credentials_refused_on_a_reconnect_are_not_retried_either(
    redis_url: str, acl_user: str, settings: Any, r: redis.Redis
) -> None:
    """A client that was up, whose password was changed under it: one clear error at
    once, not a minute of backoff (retries are for dropped connections)."""
    with FleetClient(as_user(redis_url, acl_user, "right-password"), settings=settings) as c:
        job_id = c.submit("hi", require_worker=False)
        r.execute_command("ACL", "SETUSER", acl_user, "resetpass", ">rotated", **every_node(r))
        # Its connections drop.
        r.execute_command("CLIENT", "KILL", "USER", acl_user, **every_node(r))
        with pytest.raises(RedisAuthFailed):
            c.status(job_id)
        assert refused_logins(r, acl_user) == 1  # the reconnect, not retried


async def test_the_async_client_fails_at_once_on_a_wrong_password(
    redis_url: str, acl_user: str, settings: Any, r: redis.Redis
) -> None:
    async with AsyncFleetClient(as_user(redis_url, acl_user, "nope"), settings=settings) as c:
        with pytest.raises(RedisAuthFailed, match=r":\*\*\*@"):
            await c.status("x")
    assert refused_logins(r, acl_user) == 1  # one attempt: no retry


def unreachable(settings: Any, port: int | None = None) -> str:
    """A URL of the tests' kind (one server or a cluster) at ``port``, by default
    one where nothing listens."""
    scheme = settings.redis_url.split("://", 1)[0]
    return f"{scheme}://127.0.0.1:{port or free_port()}" + ("" if "+cluster" in scheme else "/0")


def test_an_unreachable_redis_fails_at_once_naming_the_url(
    settings: Any, report: dict[str, Any]
) -> None:
    url = unreachable(settings)
    started = time.monotonic()
    with pytest.raises(RedisUnavailable) as info:
        with FleetClient(url, settings=settings) as c:
            c.submit("hi", require_worker=False)
    seconds = time.monotonic() - started
    assert isinstance(info.value, ConnectionError)
    assert url in str(info.value) and "\n" not in str(info.value)
    report.update(unreachable_error_after_s=round(seconds, 3))


async def test_the_async_client_fails_at_once_on_an_unreachable_redis(settings: Any) -> None:
    url = unreachable(settings)
    async with AsyncFleetClient(url, settings=settings) as c:
        with pytest.raises(RedisUnavailable, match="cannot connect to Redis at redis"):
            await c.submit("hi", require_worker=False)


class HangUp:
    """A server that takes each connection and closes it at once, counting them:
    a Redis that was never there, whose every connection attempt can be seen."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        self.sock.close()
        self.thread.join()


@pytest.fixture
def hang_up() -> Iterator[HangUp]:
    server = HangUp()
    yield server
    server.close()


def test_a_first_connect_that_fails_is_tried_once_not_retried(
    settings: Any, hang_up: HangUp
) -> None:
    url = unreachable(settings, hang_up.port)
    with pytest.raises(RedisUnavailable, match="cannot connect to Redis"):
        with FleetClient(url, settings=settings) as c:
            c.submit("hi", require_worker=False)
    assert hang_up.accepted == 1


async def test_the_async_client_tries_a_failed_first_connect_once_too(
    settings: Any, hang_up: HangUp
) -> None:
    url = unreachable(settings, hang_up.port)
    async with AsyncFleetClient(url, settings=settings) as c:
        with pytest.raises(RedisUnavailable, match="cannot connect to Redis"):
            await c.submit("hi", require_worker=False)
    assert hang_up.accepted == 1


@contextmanager
def down_for_a_second(aof_redis: Any, report: dict[str, Any]) -> Iterator[None]:
    """Stop the test's Redis and start it again a second later; what runs inside
    (a command) must wait for it and answer once it is back."""
    aof_redis.stop()
    restarting = threading.Event()

    def restart() -> None:
        restarting.set()
        aof_redis.start()

    timer = threading.Timer(1.0, restart)
    timer.start()
    started = time.monotonic()
    try:
        yield
        answered_while_down = not restarting.is_set()
    finally:
        timer.join()
    seconds = time.monotonic() - started
    assert not answered_while_down  # it answered once Redis came back: it rode out the outage
    report.update(outage_s=1.0, answered_after_s=round(seconds, 2))


def test_a_connection_that_was_up_is_still_retried_through_a_restart(
    aof_redis: Any, report: dict[str, Any]
) -> None:
    """Fail-fast is for the first connect only: a dropped connection rides out a restart."""
    from tokenfleet.shared.settings import Settings

    settings = Settings(queue="default", redis_url=aof_redis.url, namespace="restart")
    with FleetClient(settings=settings) as c:
        job_id = c.submit("hi", require_worker=False)
        with down_for_a_second(aof_redis, report):
            assert c.status(job_id).status is JobStatus.QUEUED  # retried until it is back


async def test_a_client_whose_only_contact_was_a_subscription_rides_out_a_restart(
    aof_redis: Any, report: dict[str, Any]
) -> None:
    """A stream subscribes before its first command: if Redis goes down in
    between, that command waits for Redis to come back; it does not fail as
    if Redis had never been there (on a cluster the subscription reads the slot
    map, through no command)."""
    from tokenfleet.shared.redis.connect import connect_async, ready

    client = connect_async(aof_redis.url)
    try:
        pubsub = (await ready(client)).pubsub()
        await pubsub.subscribe("tokenfleet-test:contact")
        await pubsub.aclose()
        with down_for_a_second(aof_redis, report):
            assert await client.get("tokenfleet-test:nothing") is None  # retried until back
    finally:
        await client.aclose()
