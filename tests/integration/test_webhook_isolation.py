"""No tenant's webhooks hurt another's, on a real redis-server: receivers that
hang or drip, a flood of events, a huge answer; and no webhook aimed inward
(the fleet's loopback, private addresses, its own Redis) is ever posted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from tokenfleet import InvalidRequest
from tokenfleet.cli.app import main

from gateway_server import gateway  # noqa: F401  (a fixture)
from test_webhooks import (LOOPBACK, SECRET, Fleet, Receiver, fleet_of, hook_settings,  # noqa: F401
                           receiver, until)

pytestmark = pytest.mark.timeout(120)


async def add(fleet: Fleet, tenant: str, url: str, n: int = 1) -> list[str]:
    """``n`` events of ``tenant`` to ``url``, written to the outbox as the fleet
    writes them (a batch's end); their ids."""
    ids = [f"msg_{uuid.uuid4().hex}" for _ in range(n)]
    pipe = fleet.redis.pipeline(transaction=False)
    for event_id in ids:
        pipe.xadd(fleet.keys.webhook_outbox, {"id": event_id, "type": "batch.completed",
                                              "data": '{"id":"batch_x"}', "url": url,
                                              "tenant": tenant})
    await pipe.execute()
    return ids


@contextlib.asynccontextmanager
async def stalling_receivers() -> AsyncIterator[tuple[str, str, list[int]]]:
    """Two receivers on loopback: one that never answers, one that drips its
    answer a byte a second (each read well inside any read timeout). Yields
    their URLs and the count of connections each has taken."""
    taken = [0, 0]

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        taken[0] += 1
        with contextlib.suppress(Exception):
            await reader.read(-1)  # until the client gives up
        writer.close()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        taken[1] += 1
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            for byte in b"HTTP/1.1 200 OK\r\nx-slow: " + b"a" * 10_000:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1.0)
        writer.close()

    servers = [await asyncio.start_server(handler, "127.0.0.1", 0) for handler in (hang, drip)]
    try:
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        yield f"http://127.0.0.1:{ports[0]}/hang", f"http://127.0.0.1:{ports[1]}/drip", taken
    finally:
        for server in servers:
            server.close()


async def test_another_tenants_webhook_arrives_within_5s_while_64_receivers_hang_or_drip(
        hook_settings: Any, receiver: Receiver) -> None:
    """The issue's case: 64 receivers of one tenant hold their attempts as long
    as they may (the default 10 s); another tenant's event still goes out at
    once, on a slot that tenant cannot take."""
    settings = hook_settings.model_copy(update={"webhook_timeout_s": 10.0})
    receiver.start()
    async with fleet_of(settings) as fleet, stalling_receivers() as (hang, drip, taken):
        for i in range(32):
            await add(fleet, "slow", f"{hang}/{i}")
            await add(fleet, "slow", f"{drip}/{i}")
        fleet.deliverer()
        await until(lambda: _true(sum(taken) >= 4), 10, "the slow tenant's attempts to start")
        sent = time.monotonic()
        [event_id] = await add(fleet, "other", receiver.url)
        got = await receiver.until(lambda r: any(x.id == event_id for x in r), 30,
                                   "the other tenant's event")
        assert time.monotonic() - sent < 5.0, f"took {time.monotonic() - sent:.1f}s"
        assert got[-1].id == event_id


async def _true(value: bool) -> bool:
    return value


async def test_an_attempt_at_a_dripping_receiver_ends_at_its_time_budget(
        hook_settings: Any) -> None:
    """A byte a second keeps every read inside its timeout; the attempt as a
    whole still fails at webhook_timeout_s and is retried later."""
    async with fleet_of(hook_settings.model_copy(update={"webhook_timeout_s": 1.5})) as fleet, \
            stalling_receivers() as (_, drip, _taken):
        await add(fleet, "slow", drip)
        fleet.deliverer()
        started = time.monotonic()
        attempts = await until(lambda: fleet.redis.xrange(fleet.keys.webhook_attempts), 20,
                               "the first attempt's end")
        assert time.monotonic() - started < 1.5 + 3.0
        assert b"no answer within 1.5 s" in attempts[0][1][b"error"]


async def test_a_2xx_whose_body_drips_counts_as_delivered_at_the_time_budget(
        hook_settings: Any) -> None:
    """The status is the answer: a body that never ends is cut off at the
    budget, and the event is not posted again."""
    async def slow_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n")
        with contextlib.suppress(Exception):
            while True:
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.5)

    server = await asyncio.start_server(slow_body, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    try:
        async with fleet_of(hook_settings.model_copy(update={"webhook_timeout_s": 1.5})) as fleet:
            await add(fleet, "t", url)
            fleet.deliverer()
            attempts = await until(lambda: fleet.redis.xrange(fleet.keys.webhook_attempts), 20,
                                   "the attempt")
            assert attempts[0][1][b"status"] == b"200"
            assert await fleet.redis.zcard(fleet.keys.webhook_lane("t")) == 0
    finally:
        server.close()


@contextlib.contextmanager
def peak_rss() -> Iterator[list[int]]:
    """The most this process's resident memory grew (bytes) while the block ran,
    sampled every 5 ms."""
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss() - base)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()


async def test_a_300_mb_answer_is_not_read_and_memory_does_not_grow(hook_settings: Any) -> None:
    served = asyncio.Event()
    sent = [0]

    async def huge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        size = 300 * 1024 * 1024
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        chunk = b"x" * (1024 * 1024)
        with contextlib.suppress(Exception):
            while sent[0] < size:
                writer.write(chunk)
                await writer.drain()
                sent[0] += len(chunk)
        served.set()
        writer.close()

    server = await asyncio.start_server(huge, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/big"
    try:
        async with fleet_of(hook_settings.model_copy(update={"webhook_timeout_s": 30.0})) as fleet:
            await add(fleet, "big", url)
            with peak_rss() as grew:
                fleet.deliverer()
                attempts = await until(lambda: fleet.redis.xrange(fleet.keys.webhook_attempts),
                                       60, "the attempt")
                await asyncio.wait_for(served.wait(), 30)
            assert attempts[0][1][b"status"] == b"200"
            assert grew[0] < 50 * 1024 * 1024, f"grew {grew[0] / 2**20:.0f} MB"
            assert sent[0] < 100 * 1024 * 1024  # the receiver was cut off, not read to its end
    finally:
        server.close()


async def test_a_flood_of_2000_events_neither_delays_another_tenant_nor_passes_its_caps(
        hook_settings: Any, receiver: Receiver) -> None:
    """A 2,000-line batch with a webhook_url per line, its receiver failing:
    the tenant's lane keeps webhook_tenant_queued events, the rest go to its
    own dead letters, kept to webhook_tenant_dead; another tenant's event goes
    out within 5 s and its dead letters are untouched."""
    failing = Receiver()
    failing.answers = [503] * 1_000_000
    failing.start()
    receiver.start()
    settings = hook_settings.model_copy(update={"webhook_tenant_queued": 500,
                                                "webhook_tenant_dead": 300})
    try:
        async with fleet_of(settings) as fleet:
            await add(fleet, "other", "ftp://example.com/never")  # other's own dead letter
            await add(fleet, "flood", failing.url, 2_000)
            fleet.deliverer()
            await until(lambda: fleet.redis.xlen(fleet.keys.webhook_dead_of("flood")), 10,
                        "the flood's overflow")
            sent = time.monotonic()
            [event_id] = await add(fleet, "other", receiver.url)
            await receiver.until(lambda r: any(x.id == event_id for x in r), 30,
                                 "the other tenant's event")
            assert time.monotonic() - sent < 5.0, f"took {time.monotonic() - sent:.1f}s"
            assert await fleet.redis.zcard(fleet.keys.webhook_lane("flood")) <= 500
            dead = await fleet.redis.xrange(fleet.keys.webhook_dead_of("flood"))
            assert len(dead) == 300
            assert b"TOKENFLEET_WEBHOOK_TENANT_QUEUED" in dead[-1][1][b"last_error"]
            [(_, other)] = await fleet.redis.xrange(fleet.keys.webhook_dead_of("other"))
            assert other[b"url"] == b"ftp://example.com/never"
    finally:
        failing.stop()


async def test_a_tenant_cannot_flood_the_dead_letters_beyond_its_cap(hook_settings: Any) -> None:
    async with fleet_of(hook_settings.model_copy(update={"webhook_tenant_dead": 20})) as fleet:
        await add(fleet, "other", "ftp://example.com/mine")
        await add(fleet, "flood", "ftp://example.com/x", 300)
        fleet.deliverer()
        await until(lambda: _outbox_and_lanes_empty(fleet, "flood"), 20, "every event handled")
        assert await fleet.redis.xlen(fleet.keys.webhook_dead_of("flood")) == 20
        [(_, mine)] = await fleet.redis.xrange(fleet.keys.webhook_dead_of("other"))
        assert mine[b"url"] == b"ftp://example.com/mine"


async def _outbox_and_lanes_empty(fleet: Fleet, tenant: str) -> bool:
    return (await fleet.redis.xlen(fleet.keys.webhook_outbox) == 0
            and await fleet.redis.zcard(fleet.keys.webhook_lane(tenant)) == 0
            and await fleet.redis.xlen(fleet.keys.webhook_dead_of(tenant)) > 0)


async def test_each_tenants_events_verify_with_its_own_secret_only(
        hook_settings: Any, receiver: Receiver) -> None:
    """A batch's event and a job's (its end written by cancel.lua) are signed
    with their tenant's secret."""
    receiver.start()
    async with fleet_of(hook_settings) as fleet:
        await add(fleet, "acme", receiver.url)
        fleet.deliverer()
        got = (await receiver.until(lambda r: len(r) >= 1, 10, "acme's batch event"))[0]
        job_id = await fleet.client.submit("a", model="nobody", require_worker=False,
                                           tenant="acme", webhook_url=receiver.url)
        assert await fleet.client.cancel(job_id)
        received = await receiver.until(lambda r: any(b"job.cancelled" in x.body for x in r),
                                        10, "acme's job event")
        [job] = [x for x in received if b"job.cancelled" in x.body]
    env = {"TOKENFLEET_WEBHOOK_SECRET": SECRET}
    printed = CliRunner().invoke(main, ["webhooks", "secret", "--tenant", "acme"], env=env)
    assert printed.exit_code == 0, printed.output
    acme = printed.output.strip().splitlines()[-1]
    assert Webhook(acme).verify(got.body, got.headers)["type"] == "batch.completed"
    assert Webhook(acme).verify(job.body, job.headers)["data"]["id"] == job_id
    other = CliRunner().invoke(main, ["webhooks", "secret", "--tenant", "globex"], env=env)
    for secret in (SECRET, other.output.strip().splitlines()[-1]):
        for one in (got, job):
            with pytest.raises(WebhookVerificationError):
                Webhook(secret).verify(one.body, one.headers)


def internal_forms(port: int) -> list[str]:
    """URLs of the receiver on ``port`` (on 127.0.0.1) as a tenant could spell them."""
    forms = [f"http://{host}:{port}/admin" for host in (
        "127.0.0.1", "2130706433", "0x7f000001", "0177.0.0.1", "127.1", "[::ffff:127.0.0.1]",
        "localhost")]
    return forms


async def test_every_internal_form_is_refused_at_submit(settings: Any, receiver: Receiver
                                                        ) -> None:
    async with fleet_of(settings) as fleet:  # no allowlist: the fleet's defaults
        for url in [*internal_forms(receiver.port), "http://[::1]:9/",
                    "http://169.254.169.254/latest/meta-data/", "http://10.0.0.7/",
                    f"http://user:pw@example.com:{receiver.port}/"]:
            with pytest.raises(InvalidRequest, match="webhook_url") as refused:
                await fleet.client.submit("x", webhook_url=url, require_worker=False)
            assert refused.value.errors[0]["loc"] == ["webhook_url"]


async def test_every_internal_form_is_refused_at_connect_and_nothing_is_posted(
        settings: Any, receiver: Receiver) -> None:
    """Events already in the outbox (queued by an older client, or before the
    operator narrowed the allowlist): none reaches the receiver; each is a dead
    letter naming why. A DNS name that resolves to loopback is refused by the
    address it resolves to; the fleet's Redis even when loopback is allowed."""
    receiver.start()
    hostname = socket.gethostname()
    resolves = {info[4][0] for info in socket.getaddrinfo(hostname, None)}
    forms = internal_forms(receiver.port)
    if resolves and all(a.startswith("127.") for a in resolves):
        forms.append(f"http://{hostname}:{receiver.port}/admin")  # a name, looked up at connect
    redis_port = int(settings.redis_url.rsplit(":", 1)[1].split("/")[0])
    async with fleet_of(settings.model_copy(update={"webhook_secret": SECRET})) as fleet:
        for url in forms:
            await add(fleet, "t", url)
        plain = fleet.deliverer()  # the fleet's defaults: no allowlist
        await until(lambda: _all_dead(fleet, "t", len(forms)), 20, "every event given up")
        await plain.stop()
        fleet.deliverer("allows-loopback", webhook_allow=LOOPBACK)
        await add(fleet, "t", f"http://127.0.0.1:{redis_port}/")
        dead = await until(lambda: _all_dead(fleet, "t", len(forms) + 1), 20,
                           "the Redis port's event given up")
        for _, fields in dead:
            assert b"refused" in fields[b"last_error"], fields
        assert b"the fleet's Redis" in dead[-1][1][b"last_error"]
        assert receiver.received == []


async def _all_dead(fleet: Fleet, tenant: str, n: int) -> Any:
    dead = await fleet.redis.xrange(fleet.keys.webhook_dead_of(tenant))
    return dead if len(dead) == n else None


def test_the_gateway_refuses_an_internal_webhook_url_and_batch_metadata_with_a_400(
        gateway: Any, receiver: Receiver) -> None:
    http = gateway()
    for url in internal_forms(receiver.port):
        bad = http.post("/v1/completions", json={"model": "default", "prompt": "Hi",
                                                  "webhook_url": url})
        assert bad.status_code == 400, (url, bad.text)
        assert bad.json()["error"]["param"] == "webhook_url"
        assert "refused" in bad.json()["error"]["message"]
    batch = http.post("/v1/batches", json={"input_file_id": "file-x", "endpoint":
                                           "/v1/completions", "completion_window": "24h",
                                           "metadata": {"webhook_url": internal_forms(80)[2]}})
    assert batch.status_code == 400 and batch.json()["error"]["param"] == "metadata.webhook_url"


async def test_the_operators_own_webhook_url_may_be_internal(settings: Any,
                                                              receiver: Receiver) -> None:
    """TOKENFLEET_WEBHOOK_URL is the operator's: not checked against the allowlist."""
    receiver.start()
    async with fleet_of(settings) as fleet:  # no allowlist
        await fleet.redis.xadd(fleet.keys.webhook_outbox, {"id": "msg_own", "type": "batch.failed",
                                                           "data": "{}", "tenant": "acme"})
        fleet.deliverer(webhook_url=receiver.url)
        got = await receiver.until(lambda r: len(r) == 1, 10, "the event")
        assert got[0].id == "msg_own"
