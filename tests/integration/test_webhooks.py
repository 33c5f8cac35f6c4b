"""Webhooks on a real redis-server: events arrive signed as Standard Webhooks, a
job's end is posted once to its webhook_url, a receiver that is down for a while
loses nothing, and a deliverer that dies leaves its events to another."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from redis.exceptions import ResponseError
from standardwebhooks import Webhook

from tokenfleet import AsyncFleetClient, InvalidRequest
from tokenfleet.client.fleet import repair_fleet
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.webhook_outbox import add_event
from tokenfleet.webhooks.delivery import GROUP, Deliverer
from tokenfleet.cli.app import main

from gateway_server import gateway, pin_live_worker  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
# The operator's allowlist that lets webhooks reach the tests' own receivers.
LOOPBACK = "127.0.0.0/8"


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered

    @property
    def id(self) -> str:
        return self.headers["webhook-id"]

    def verified(self, secret: str | bytes = SECRET) -> Any:
        return Webhook(secret).verify(self.body, self.headers)


class Receiver:
    """An HTTP server on a port of its own that records every POST; it answers
    each status of ``answers`` in turn, then 200. Not started: the port refuses."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.answers: list[int] = []
        self.received: list[Received] = []
        self._changed = threading.Condition()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._changed:
                    status = receiver.answers.pop(0) if receiver.answers else 200
                    receiver.received.append(
                        Received({k.lower(): v for k, v in self.headers.items()}, body, status))
                    receiver._changed.notify_all()
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def delivered(self) -> list[Received]:
        with self._changed:
            return [r for r in self.received if 200 <= r.status < 300]

    async def until(self, condition: Callable[[list[Received]], bool], timeout: float,
                    what: str) -> list[Received]:
        def wait() -> list[Received]:
            with self._changed:
                if not self._changed.wait_for(lambda: condition(self.received), timeout):
                    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
                return list(self.received)

        return await asyncio.to_thread(wait)


async def until(check: Callable[[], Awaitable[Any]], timeout: float, what: str) -> Any:
    """Poll Redis (another party's state: no event to await) until ``check`` holds."""
    deadline = time.monotonic() + timeout
    while not (value := await check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return value


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    one = Receiver()
    yield one
    one.stop()


@pytest.fixture
def hook_settings(settings: Any) -> Any:
    """Retries in tens of milliseconds: the schedule of 1 s doubling to 5 min,
    shrunk; the test's receivers, on loopback, allowed."""
    return settings.model_copy(update={"webhook_secret": SECRET, "webhook_backoff_s": 0.05,
                                       "webhook_backoff_max_s": 0.2,
                                       "webhook_timeout_s": 2.0, "webhook_allow": LOOPBACK})


class Fleet:
    """An asyncio client and the deliverers a test starts (all stopped at its end)."""

    def __init__(self, client: AsyncFleetClient) -> None:
        self.client = client
        self.redis, self.keys, self.settings = client.redis, client.keys, client.settings
        self.started: list[Deliverer] = []

    def deliverer(self, name: str = "d1", **overrides: Any) -> Deliverer:
        settings = self.settings.model_copy(update=overrides)
        one = Deliverer(self.redis, self.keys, settings, consumer=name, poll_s=0.05,
                        discover_s=0.2, claim_idle_s=0.5).start()
        self.started.append(one)
        return one


@contextlib.asynccontextmanager
async def fleet_of(settings: Any) -> AsyncIterator[Fleet]:
    async with AsyncFleetClient(settings=settings) as client:
        fleet = Fleet(client)
        try:
            yield fleet
        finally:
            for one in fleet.started:
                await one.stop()


async def outbox_empty(fleet: Fleet, stream: str) -> bool:
    """Every event of ``stream`` acknowledged and deleted (by the group it has),
    and every tenant's lane empty: each event delivered, dropped or given up."""
    try:
        pending = await fleet.redis.xpending(stream, GROUP)
    except ResponseError:  # no group yet: no deliverer has read it
        return False
    if await fleet.redis.xlen(stream) or pending["pending"]:
        return False
    for tenant in await fleet.redis.smembers(fleet.keys.webhook_lanes):
        if await fleet.redis.zcard(fleet.keys.webhook_lane(tenant.decode())):
            return False
    return True


async def test_an_event_arrives_signed_verifiable_with_standardwebhooks(
        hook_settings: Any, receiver: Receiver) -> None:
    async with fleet_of(hook_settings) as fleet:
        receiver.start()
        await add_event(fleet.redis, fleet.keys, "batch.completed", {"id": "batch_1", "n": 2},
                        url=receiver.url)
        fleet.deliverer()
        got = await receiver.until(lambda r: len(r) == 1, 10, "the event")
        payload = got[0].verified()
        assert payload["type"] == "batch.completed"
        assert payload["data"] == {"id": "batch_1", "n": 2}
        assert payload["timestamp"].endswith("Z")
        assert got[0].id.startswith("msg_")
        with pytest.raises(Exception, match="signature"):
            got[0].verified("whsec_" + base64.b64encode(b"another secret").decode())
        await until(lambda: outbox_empty(fleet, fleet.keys.webhook_outbox), 5,
                    "the entry to be acknowledged and deleted")


async def test_a_raw_secret_signs_with_its_own_bytes(
        hook_settings: Any, receiver: Receiver) -> None:
    async with fleet_of(hook_settings) as fleet:
        receiver.start()
        fleet.deliverer(webhook_secret="plain words", webhook_url=receiver.url)
        await add_event(fleet.redis, fleet.keys, "batch.failed", {"id": "batch_2"})  # no own URL
        got = await receiver.until(lambda r: len(r) == 1, 10, "the event")
        assert got[0].verified(b"plain words")["type"] == "batch.failed"


async def test_an_event_with_no_url_is_dropped_and_one_with_a_bad_url_is_a_dead_letter(
        hook_settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    async with fleet_of(hook_settings) as fleet:
        await add_event(fleet.redis, fleet.keys, "batch.completed", {"id": "batch_3"})
        await add_event(fleet.redis, fleet.keys, "batch.failed", {"id": "batch_4"},
                        url="ftp://example.com/hook")
        deliverer = fleet.deliverer(webhook_url="")
        await until(lambda: outbox_empty(fleet, fleet.keys.webhook_outbox), 5, "the drop")
        [(_, dead)] = await fleet.redis.xrange(fleet.keys.webhook_dead)
        assert dead[b"data"] == b'{"id":"batch_4"}' and b"http" in dead[b"last_error"]
        assert deliverer.outcomes == {"dropped": 1, "dead": 1}  # the gateway's metrics
    # No webhook was asked for (no URL anywhere): nothing to warn about, as after
    # every batch of a fleet that uses no webhooks.
    assert not [r for r in caplog.records
                if r.levelno >= logging.WARNING and "dropped" in r.getMessage()]


async def test_a_job_webhook_arrives_once_when_the_job_completes(
        hook_settings: Any, receiver: Receiver, start_worker: Any) -> None:
    async with fleet_of(hook_settings) as fleet:
        receiver.start()
        start_worker()
        fleet.deliverer()
        job_id = await fleet.client.submit("Once upon a time", max_new_tokens=4, webhook_url=receiver.url)
        assert (await fleet.client.wait(job_id, timeout=30)).status is JobStatus.SUCCEEDED
        got = await receiver.until(lambda r: len(r) >= 1, 10, "the job's webhook")
        payload = got[0].verified()
        assert payload["type"] == "job.completed"
        assert payload["data"]["id"] == job_id
        assert payload["data"]["status"] == "succeeded"
        outbox = fleet.keys.job_webhooks("default")
        await until(lambda: outbox_empty(fleet, outbox), 5, "the job outbox to be emptied")
        # Another job with no webhook_url adds nothing, and nothing came twice.
        other = await fleet.client.submit("Hello", max_new_tokens=2)
        await fleet.client.wait(other, timeout=30)
        assert await fleet.redis.xlen(outbox) == 0
        assert [r.id for r in receiver.received] == [got[0].id]


async def test_a_background_responses_end_is_posted_as_openais_response_event(
        hook_settings: Any, receiver: Receiver, start_worker: Any, gateway: Any,
        r: Any) -> None:
    """POST /v1/responses with background: the fleet's webhook URL gets
    response.completed (a response that ran) and response.cancelled (one
    cancelled in its queue), each naming the response, once."""
    receiver.start()
    start_worker()
    pin_live_worker(r, hook_settings.namespace, "idle")  # its jobs stay queued
    http = gateway(webhook_url=receiver.url, webhook_secret=SECRET,
                   webhook_backoff_s=0.05, webhook_allow=LOOPBACK)
    done = http.post("/v1/responses", json={"model": "default", "input": "Hi",
                                            "background": True, "max_output_tokens": 4})
    queued = http.post("/v1/responses", json={"model": "idle", "input": "Hi",
                                              "background": True})
    done_id, queued_id = done.json()["id"], queued.json()["id"]
    assert http.post(f"/v1/responses/{queued_id}/cancel").json()["status"] == "cancelled"
    got = await receiver.until(lambda r: len({g.id for g in r}) >= 2, 60,
                               "both responses' webhooks")
    payloads = {p["data"]["id"]: p["type"] for p in (g.verified() for g in got)}
    finished = http.get(f"/v1/responses/{done_id}").json()["status"]
    assert payloads == {done_id: f"response.{finished}", queued_id: "response.cancelled"}
    assert finished in ("completed", "incomplete")
    # One event each (a webhook id names one event, however often it is tried).
    assert len({g.id for g in receiver.received}) == 2


async def test_a_job_cancelled_or_expired_in_its_queue_is_posted_so(
        hook_settings: Any, receiver: Receiver) -> None:
    """cancel.lua and expire.lua (no worker serves the queue) add the event too."""
    async with fleet_of(hook_settings) as fleet:
        receiver.start()
        fleet.deliverer()
        cancelled = await fleet.client.submit("a", model="nobody", require_worker=False,
                                       webhook_url=receiver.url)
        expiring = await fleet.client.submit("b", model="nobody", require_worker=False, deadline_s=0.05,
                                      webhook_url=receiver.url)
        assert await fleet.client.cancel(cancelled)
        await asyncio.sleep(0.1)  # past the second job's deadline
        from tokenfleet import FleetClient

        with FleetClient(settings=fleet.settings) as sync:
            await asyncio.to_thread(repair_fleet, sync)
        got = await receiver.until(lambda r: len(r) == 2, 10, "both jobs' webhooks")
        kinds = {p["data"]["id"]: p["type"] for p in (r.verified() for r in got)}
        assert kinds == {cancelled: "job.cancelled", expiring: "job.expired"}


async def test_a_bad_webhook_url_is_refused_at_submit(hook_settings: Any) -> None:
    async with fleet_of(hook_settings) as fleet:
        for url in ("ftp://example.com/x", "example.com/hook", "http://" + "a" * 3000):
            with pytest.raises(InvalidRequest, match="webhook_url"):
                await fleet.client.submit("x", webhook_url=url, require_worker=False)


async def test_a_receiver_down_then_answering_503_then_up_loses_no_event(
        hook_settings: Any, receiver: Receiver) -> None:
    """Refused connections first, then 503s, then 200s: every event arrives,
    each retry under the event's one webhook-id."""
    async with fleet_of(hook_settings) as fleet:
        for i in range(20):
            await add_event(fleet.redis, fleet.keys, "batch.completed", {"id": f"batch_{i}"},
                            url=receiver.url)
        added = [f[b"id"].decode() for _, f in await fleet.redis.xrange(fleet.keys.webhook_outbox)]
        fleet.deliverer("d1")
        fleet.deliverer("d2")
        # Down: each event fails at least twice (the port refuses) before the receiver starts.
        await until(lambda: _failed_twice(fleet, 20), 10, "two failed attempts per event")
        receiver.answers = [503] * 10
        receiver.start()
        got = await receiver.until(lambda r: len({x.id for x in r if x.status == 200}) == 20, 20,
                                   "all 20 events delivered")
        assert sorted({x.id for x in got if x.status == 200}) == sorted(added)
        assert sum(x.status == 503 for x in got) == 10
        for x in got:
            assert x.verified()["data"]["id"].startswith("batch_")
        await until(lambda: outbox_empty(fleet, fleet.keys.webhook_outbox), 5, "an empty outbox")
        assert await fleet.redis.zcard(fleet.keys.webhook_lane("default")) == 0


async def _scheduled(fleet: Fleet) -> bool:
    """An event of the default tenant waits in its lane for a retry (its time past the lease's)."""
    lane = await fleet.redis.zrange(fleet.keys.webhook_lane("default"), 0, -1, withscores=True)
    state = [await fleet.redis.hget(fleet.keys.webhook_event(m.decode()), "next_at")
             for m, _ in lane]
    return bool(lane) and all(state)


async def _failed_twice(fleet: Fleet, events: int) -> bool:
    counts: dict[bytes, int] = {}
    for _, f in await fleet.redis.xrange(fleet.keys.webhook_attempts):
        counts[f[b"id"]] = counts.get(f[b"id"], 0) + 1
    return len(counts) == events and min(counts.values()) >= 2


async def test_an_event_past_its_retry_time_goes_to_the_dead_letters(
        hook_settings: Any, receiver: Receiver) -> None:
    async with fleet_of(hook_settings) as fleet:
        receiver.answers = [503] * 1000
        receiver.start()
        await add_event(fleet.redis, fleet.keys, "batch.expired", {"id": "batch_d"}, url=receiver.url)
        fleet.deliverer(webhook_retry_s=0.3)
        dead = await until(lambda: fleet.redis.xrange(fleet.keys.webhook_dead), 10, "a dead letter")
        fields = dead[0][1]
        assert fields[b"type"] == b"batch.expired"
        assert fields[b"last_error"].startswith(b"HTTP 503")
        assert int(fields[b"attempts"]) >= 2
        await until(lambda: outbox_empty(fleet, fleet.keys.webhook_outbox), 5, "an empty outbox")
        # Sent again by the operator, once the receiver is fixed: the same webhook-id.
        receiver.answers.clear()
        env = {"TOKENFLEET_REDIS_URL": fleet.settings.redis_url,
               "TOKENFLEET_NAMESPACE": fleet.settings.namespace}
        ran = CliRunner().invoke(main, ["webhooks", "retry", "--all"], env=env)
        assert ran.exit_code == 0, ran.output
        got = await receiver.until(lambda r: r[-1].status == 200, 10, "the event sent again")
        assert got[-1].id == got[0].id and await fleet.redis.xlen(fleet.keys.webhook_dead) == 0


async def test_an_event_read_by_a_deliverer_that_died_is_delivered_by_another(
        hook_settings: Any, receiver: Receiver) -> None:
    """A deliverer read the entry and died before its first attempt: it sits
    pending in the group, and another takes it over once idle."""
    async with fleet_of(hook_settings) as fleet:
        receiver.start()
        await add_event(fleet.redis, fleet.keys, "batch.completed", {"id": "batch_r"},
                        url=receiver.url)
        stream = fleet.keys.webhook_outbox
        await fleet.redis.xgroup_create(stream, GROUP, id="0")
        assert await fleet.redis.xreadgroup(GROUP, "dead:1", {stream: ">"})
        fleet.deliverer("d2")
        got = await receiver.until(lambda r: len(r) == 1, 10, "the event, from d2")
        assert got[0].verified()["data"] == {"id": "batch_r"}
        await until(lambda: outbox_empty(fleet, stream), 5, "an empty outbox")


async def test_a_deliverer_killed_mid_retry_leaves_the_retry_to_another(
        hook_settings: Any, receiver: Receiver) -> None:
    """`tokenfleet webhooks deliver` gets a 503, schedules the retry and is
    killed (-9); another deliverer makes the retry, under the same webhook-id."""
    async with fleet_of(hook_settings) as fleet:
        receiver.answers = [503]
        receiver.start()
        await add_event(fleet.redis, fleet.keys, "batch.cancelled", {"id": "batch_k"},
                        url=receiver.url)
        s = fleet.settings
        env = {**os.environ, "TOKENFLEET_REDIS_URL": s.redis_url, "TOKENFLEET_NAMESPACE": s.namespace,
               "TOKENFLEET_WEBHOOK_SECRET": SECRET, "TOKENFLEET_WEBHOOK_BACKOFF_S": "1",
               "TOKENFLEET_WEBHOOK_ALLOW": LOOPBACK}
        proc = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli.app", "webhooks",
                                 "deliver"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        try:
            await receiver.until(lambda r: len(r) == 1, 30, "the first attempt (answered 503)")
            await until(lambda: _scheduled(fleet), 5, "the retry's time in the lane")
        finally:
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait, 10)
        state = await fleet.redis.hgetall(fleet.keys.webhook_event(receiver.received[0].id))
        assert state[b"attempts"] == b"1" and state[b"last_status"] == b"503"
        listed = CliRunner().invoke(main, ["webhooks", "list", "--json"], env={
            "TOKENFLEET_REDIS_URL": s.redis_url, "TOKENFLEET_NAMESPACE": s.namespace})
        [waiting] = json.loads(listed.output)["waiting"]
        assert waiting["id"] == receiver.received[0].id and waiting["tenant"] == "default"
        assert waiting["last_error"] == "HTTP 503 Service Unavailable"  # no byte of the body
        fleet.deliverer("d2")
        got = await receiver.until(lambda r: len(r) == 2, 10, "the retry, from d2")
        assert got[1].status == 200 and got[1].id == got[0].id
        assert got[1].verified()["data"] == {"id": "batch_k"}
        await until(lambda: outbox_empty(fleet, fleet.keys.webhook_outbox), 5, "an empty outbox")


def test_the_gateway_delivers_the_end_of_a_completion_that_named_a_webhook_url(
        gateway: Any, start_worker: Any, receiver: Receiver) -> None:
    """webhook_url in an OpenAI request's body (extra_body), delivered by the
    deliverer the gateway runs; a bad one is a 400 naming it."""
    receiver.start()
    start_worker()
    http = gateway(webhook_secret=SECRET, webhook_allow=LOOPBACK)
    bad = http.post("/v1/completions", json={"model": "default", "prompt": "Hi",
                                              "webhook_url": "ftp://example.com/hook"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "webhook_url"
    done = http.post("/v1/completions", json={"model": "default", "prompt": "Hi",
                                               "max_tokens": 2, "webhook_url": receiver.url})
    assert done.status_code == 200, done.text
    got = asyncio.run(receiver.until(lambda r: len(r) == 1, 15, "the job's webhook"))
    payload = got[0].verified()
    assert payload["type"] == "job.completed" and payload["data"]["status"] == "succeeded"
