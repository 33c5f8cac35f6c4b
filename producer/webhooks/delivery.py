"""The webhook deliverer: posts the outbox's events, retrying until they land.

Every gateway runs one (``tokenfleet webhooks deliver`` runs one alone). It
reads the outbox streams as the consumer group ``deliverers``: the fleet's
(``Keys.webhook_outbox``: batch events) and each queue's (``Keys.job_webhooks``:
job events, added by the script that ends the job). Each event is posted,
signed with its tenant's key (``tokenfleet.webhooks.signing``), to its own URL or
else ``TOKENFLEET_WEBHOOK_URL``.

- **Lanes.** An event read from an outbox is moved at once into its tenant's
  lane (``webhook_lanes``) and deleted from the stream. Deliverers take
  the tenants' lanes in turn, one event each round, and run at most
  ``webhook_tenant_concurrency`` attempts of one tenant at once: a tenant with
  2,000 events, or 64 receivers that hang, holds a few slots, and another
  tenant's event goes out at the next free one. Within a lane, new events and
  due retries go by due time. A lane holds at most ``webhook_tenant_queued``
  events; one more is a dead letter at once.
- **Attempts.** A 2xx answer deletes the event. Any other answer, a timeout or a
  refused connection schedules the next attempt in the lane: 1 s doubling up to
  5 min (jittered), for ``webhook_retry_s`` after the first failure; then the
  event goes to its tenant's dead letters (``Keys.webhook_dead_of``, capped at
  ``webhook_tenant_dead``) with its last error. A destination that is not
  allowed (``webhook_destination``) is a dead letter at once. Each attempt is
  bounded in time and answer size (``webhook_connect``).
- **Nothing lives in a deliverer's memory.** Taking an event leases it
  (``webhook_take.lua`` moves its score to the lease's end), so an event whose
  deliverer dies mid-attempt comes due again; every attempt is a line of a
  capped stream (``Keys.webhook_attempts``). An entry a deliverer read and then
  died with, before it reached a lane, stays pending in the group and another
  takes it over (XAUTOCLAIM), as workers reclaim a dead worker's jobs.

Delivery is at least once: a deliverer that dies after the receiver answered
and before recording it posts that event again; the receiver drops the repeat
by its ``webhook-id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import random
import socket
import time
from collections import Counter
from typing import Any

import httpcore
from redis.exceptions import RedisError, ResponseError

from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.webhook_destination import policy_of, url_problem
from tokenfleet.shared.webhook_outbox import webhook_url_problem
from tokenfleet.webhooks.connect import Outcome, connection_pool, post
from tokenfleet.webhooks.lanes import Event, Lanes, as_text
from tokenfleet.webhooks.signing import body, event_time, headers, secret_key, tenant_key

log = logging.getLogger("tokenfleet.webhooks")

GROUP = "deliverers"
# How often the list of queue outboxes is read again (a queue new to the fleet).
DISCOVER_S = 5.0
# Entries read from one outbox at a time, and the most reads of one outbox in a
# pass (moving an event to its lane is quick; the loop then starts attempts).
INTAKE = 256
INTAKE_ROUNDS = 8
# An attempt's lease outlasts its time budget by this much: only a deliverer
# that died (or a loop stalled that long) lets another take the event meanwhile.
LEASE_MARGIN_S = 30.0
# How long stop() waits for the loop to end its turn before cancelling it.
STOP_S = 5.0
# Every address: the operator's own TOKENFLEET_WEBHOOK_URL may be internal.
ANYWHERE = ((ipaddress.ip_network("0.0.0.0/0"), None), (ipaddress.ip_network("::/0"), None))


def consumer_name() -> str:
    """This process's name in the group: its host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


def backoff_s(failures: int, first_s: float, max_s: float) -> float:
    """The wait after the ``failures``-th failed attempt: ``first_s`` doubling,
    capped at ``max_s``, then jittered down by up to half, so the retries of
    many events failed at once spread out."""
    wait = min(max_s, first_s * 2.0 ** min(failures - 1, 62))
    return wait * random.uniform(0.5, 1.0)


class Deliverer:
    """Delivers webhook events from the outboxes until ``stop()``.

    ``claim_idle_s``: how long a read entry may sit untouched (not moved to a
    lane) before another deliverer takes it over. ``poll_s``: the wait between
    two looks at the lanes when nothing is due; ``discover_s``: between two
    listings of the queues' outboxes (a queue's first job event waits for one).
    """

    def __init__(self, redis: Any, keys: Keys, settings: Settings, *,
                 consumer: str | None = None, claim_idle_s: float | None = None,
                 poll_s: float = 0.5, discover_s: float = DISCOVER_S) -> None:
        self.redis, self.keys, self.settings = redis, keys, settings
        self.consumer = consumer or consumer_name()
        self.claim_idle_s = claim_idle_s or max(60.0, 3 * settings.webhook_timeout_s)
        self.poll_s, self.discover_s = poll_s, discover_s
        self.lease_s = settings.webhook_timeout_s + LEASE_MARGIN_S
        self._key = secret_key(settings.webhook_secret) if settings.webhook_secret else None
        self._policy = policy_of(settings)
        self.lanes = Lanes(redis, keys, settings)
        self._pools: dict[bool, httpcore.AsyncConnectionPool] = {}
        self._streams: list[str] = []
        self._grouped: set[str] = set()
        self._discovered = self._reclaimed = float("-inf")
        self._running: dict[str, asyncio.Task[None]] = {}  # event id -> its attempt
        self._events: dict[str, Event] = {}  # event id -> the event being posted
        self._per_tenant: Counter[str] = Counter()  # attempts running, by tenant
        self._freed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._turn = 0  # which tenant's lane the next pass takes from first
        self._warned: set[str] = set()
        # Attempts by outcome, for the gateway's metrics: delivered, failed
        # (retried later), dead (given up), dropped (no URL to post to).
        self.outcomes: Counter[str] = Counter()

    # -- life ------------------------------------------------------------------------

    def start(self, run: bool = True) -> Deliverer:
        """Run in the background of the current event loop (unless ``run`` is
        False: a gateway with ``TOKENFLEET_GATEWAY_WEBHOOKS`` off)."""
        if run:
            self._task = asyncio.create_task(self.run(), name="webhook-deliverer")
        return self

    async def stop(self) -> None:
        """Stop reading; attempts under way are cancelled, and their events
        made due again at once for this or another deliverer."""
        self._stopping = True
        self._freed.set()
        if self._task is not None:
            # The loop ends at its next turn. A cancel is only the fallback: on
            # 3.11 one that lands as a Redis read times out is taken for the
            # timeout (asyncio.timeout in redis-py), and the loop would go on.
            done, _ = await asyncio.wait({self._task}, timeout=STOP_S)
            if not done:
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        cut = list(self._events.values())
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        if cut:  # else each would wait for its lease to end
            with contextlib.suppress(RedisError, OSError):
                await self.lanes.hand_back(cut)
        for pool in self._pools.values():
            await pool.aclose()

    async def run(self) -> None:
        backoff = 0.1
        while not self._stopping:
            try:
                busy = await self.once()
                backoff = 0.1
            except (RedisError, OSError) as exc:
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    self._grouped.clear()  # Redis lost the group (a restart): make it again
                log.warning("webhook deliverer: Redis error (%s); again in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            if not busy and not self._stopping:
                # Woken by a freed slot, a stop(), or after poll_s.
                self._freed.clear()
                wake = asyncio.get_running_loop().call_later(self.poll_s, self._freed.set)
                try:
                    await self._freed.wait()
                finally:
                    wake.cancel()

    # -- one pass ---------------------------------------------------------------------

    async def once(self) -> bool:
        """Move new (and reclaimed) outbox entries to their lanes, then start
        what is due, the tenants in turn, as far as free slots allow; True when
        anything moved or started."""
        now = time.monotonic()
        full = now - self._discovered >= self.discover_s
        if full or self.keys.webhook_outbox not in self._grouped:
            await self._discover(full)
            if full:
                self._discovered = now
        moved = 0
        if now - self._reclaimed >= self.claim_idle_s / 2:
            self._reclaimed = now
            moved += await self._reclaim()
        moved += await self._read_new()
        return moved + await self._dispatch() > 0

    @property
    def _free(self) -> int:
        return int(self.settings.webhook_concurrency) - len(self._running)

    async def _discover(self, full: bool) -> None:
        """Join the group of each outbox that exists (the fleet's, and with
        ``full`` each queue's, listed again). A stream is not made here: a
        fleet that sends no webhooks keeps no keys for them."""
        streams = {self.keys.webhook_outbox, *self._streams}
        if full:
            async for key in self.redis.scan_iter(match=self.keys.job_webhooks_pattern(),
                                                  count=500):
                streams.add(as_text(key))
        for stream in streams - self._grouped:
            try:
                # From the start: events added before any deliverer ran are delivered.
                await self.redis.xgroup_create(stream, GROUP, id="0")
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    if "requires the key to exist" in str(exc):
                        continue  # no event yet
                    raise
            self._grouped.add(stream)
        self._streams = sorted(self._grouped)

    async def _read_new(self) -> int:
        """Move new outbox entries to their tenants' lanes."""
        moved = 0
        for stream in self._streams:
            for _ in range(INTAKE_ROUNDS):
                reply = await self.redis.xreadgroup(GROUP, self.consumer, {stream: ">"},
                                                    count=INTAKE)
                entries = [e for _, batch in reply or [] for e in batch]
                moved += await self.lanes.intake(stream, GROUP, entries)
                if len(entries) < INTAKE:
                    break
        return moved

    async def _reclaim(self) -> int:
        """Take over entries a dead deliverer read and left before they reached
        a lane: idle in the group past ``claim_idle_s``."""
        moved = 0
        idle_ms = int(self.claim_idle_s * 1000)
        for stream in self._streams:
            cursor = "0-0"
            while True:
                reply = await self.redis.xautoclaim(stream, GROUP, self.consumer, idle_ms,
                                                    start_id=cursor, count=INTAKE)
                cursor = as_text(reply[0])
                if reply[1]:
                    log.info("webhook deliverer: took over %d event(s) of %s left by another",
                             len(reply[1]), stream)
                moved += await self.lanes.intake(stream, GROUP, reply[1])
                if cursor == "0-0":
                    break
        return moved

    async def _dispatch(self) -> int:
        """Start due events, one per tenant in each round, as far as free slots
        and each tenant's ``webhook_tenant_concurrency`` allow. The first tenant
        moves on by one each pass, so no tenant is always served first."""
        if self._free <= 0:
            return 0
        tenants = await self.lanes.tenants()
        if not tenants:
            return 0
        self._turn = (self._turn + 1) % len(tenants)
        open_lanes = tenants[self._turn:] + tenants[:self._turn]
        started = 0
        while open_lanes and self._free > 0:
            for tenant in list(open_lanes):
                if self._free <= 0:
                    break
                if self._per_tenant[tenant] >= self.settings.webhook_tenant_concurrency:
                    open_lanes.remove(tenant)
                    continue
                taken, event = await self.lanes.take(tenant, self.lease_s)
                if not taken:
                    open_lanes.remove(tenant)
                elif event is not None and event.id not in self._running:
                    self._begin(event)
                    started += 1
        return started

    # -- one attempt --------------------------------------------------------------------

    def _begin(self, event: Event) -> None:
        task = asyncio.create_task(self._attempt(event), name=f"webhook {event.id}")
        self._running[event.id] = task
        self._events[event.id] = event
        self._per_tenant[event.tenant] += 1
        task.add_done_callback(lambda _: self._done(event))

    def _done(self, event: Event) -> None:
        self._running.pop(event.id, None)
        self._events.pop(event.id, None)
        self._per_tenant[event.tenant] -= 1
        if self._per_tenant[event.tenant] <= 0:
            del self._per_tenant[event.tenant]
        self._freed.set()

    async def _attempt(self, event: Event) -> None:
        try:
            own = event.url is None  # the operator's TOKENFLEET_WEBHOOK_URL: not checked
            url = event.url or self.settings.webhook_url
            if not url:  # no webhook was asked for (a batch's end in a fleet without any)
                log.debug("webhook event %s (%s) dropped: it names no URL and "
                          "TOKENFLEET_WEBHOOK_URL is not set", event.id, event.type)
                self.outcomes["dropped"] += 1
                await self.lanes.forget(event)
                return
            # Checked again here: an event queued before a check, or by an older client.
            problem = webhook_url_problem(url) or (None if own else
                                                   url_problem(url, self._policy))
            if problem:  # no attempt could ever land: given up at once, with the reason
                self.outcomes["dead"] += 1
                await self.lanes.dead(event, url, 0, Outcome(None, problem))
                return
            if self._key is None:
                self._warn_once("no-secret", "webhook events go out unsigned: set "
                                "TOKENFLEET_WEBHOOK_SECRET so receivers can verify them")
            key = None if self._key is None else tenant_key(self._key, event.tenant)
            payload = body(event.type, event_time(event.entry), event.data)
            outcome = await post(self._pool(own), url, payload,
                                 headers(event.id, int(time.time()), payload, key),
                                 self.settings.webhook_timeout_s)
            await self._record(event, url, outcome)
        except asyncio.CancelledError:
            raise
        except Exception:  # the event stays leased in its lane: due again when that ends
            log.exception("webhook deliverer: attempt at %s failed", event.id)

    def _pool(self, own: bool) -> httpcore.AsyncConnectionPool:
        """The connection pool of tenants' URLs (checked), or of the operator's own."""
        if own not in self._pools:
            policy = dataclasses.replace(self._policy, networks=ANYWHERE) if own \
                else self._policy
            self._pools[own] = connection_pool(policy, self.settings.webhook_concurrency)
        return self._pools[own]

    async def _record(self, event: Event, url: str, outcome: Outcome) -> None:
        """Store the attempt; then delete the event, schedule the next, or give up."""
        now = time.time()
        attempt = {"id": event.id, "type": event.type, "url": url, "tenant": event.tenant,
                   "at": repr(now), "deliverer": self.consumer, "error": outcome.error,
                   "status": "" if outcome.status is None else str(outcome.status)}
        if outcome.delivered:
            self.outcomes["delivered"] += 1
            await self.lanes.forget(event, attempt)
            return
        failures, first = await self.lanes.failed(event, attempt, now)
        wait = backoff_s(failures, self.settings.webhook_backoff_s,
                         self.settings.webhook_backoff_max_s)
        # A destination not allowed is given up at once: no retry would be.
        if outcome.refused or now + wait > first + self.settings.webhook_retry_s:
            self.outcomes["dead"] += 1
            await self.lanes.dead(event, url, failures, outcome)
            return
        self.outcomes["failed"] += 1
        await self.lanes.retry_at(event, outcome, now, now + wait)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)

