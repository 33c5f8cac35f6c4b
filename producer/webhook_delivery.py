"""The webhook deliverer: posts the outbox's events, retrying until they land.

Every gateway runs one (``tokenfleet webhooks deliver`` runs one alone). It
reads the outbox streams as the consumer group ``deliverers``: the fleet's
(``Keys.webhook_outbox``: batch events) and each queue's (``Keys.job_webhooks``:
job events, added by the script that ends the job). Each event is posted,
signed (``tokenfleet.webhook_signing``), to its own URL or else
``TOKENFLEET_WEBHOOK_URL``.

- A 2xx answer acknowledges and deletes the entry. Any other answer, a timeout
  or a refused connection schedules the next attempt: 1 s doubling up to 5 min
  (jittered), for ``webhook_retry_s`` after the first failure; then the event
  goes to the dead letters (``Keys.webhook_dead``) with its last error.
- Nothing of that lives in a deliverer's memory. The entry stays pending in the
  group until it is delivered; its next attempt is a member of a sorted set
  (``Keys.webhook_schedule``) any deliverer takes when due (ZREM decides who);
  its attempts so far are a hash (``Keys.webhook_event``) an operator can read,
  and every attempt is a line of a capped stream (``Keys.webhook_attempts``).
  An entry a deliverer read and then died with, before scheduling anything,
  goes idle in the group and another takes it over (XAUTOCLAIM), as workers
  reclaim a dead worker's jobs.
- At most ``webhook_concurrency`` posts run at once, each bounded by
  ``webhook_timeout_s``, so one slow receiver does not hold the others.

Delivery is at least once: a deliverer that dies after the receiver answered
and before the acknowledgement posts that event again; the receiver drops the
repeat by its ``webhook-id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
from redis.exceptions import RedisError, ResponseError

from tokenfleet.shared.keys import Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.webhook_outbox import webhook_url_problem
from tokenfleet.webhook_signing import body, event_time, headers, secret_key

log = logging.getLogger("tokenfleet.webhooks")

GROUP = "deliverers"
# How often the list of queue outboxes is read again (a queue new to the fleet).
DISCOVER_S = 5.0
# Lines the attempts stream keeps (approximately: MAXLEN ~).
ATTEMPTS_KEPT = 10_000
# Longest error text stored with an attempt.
MAX_ERROR = 300
# How long stop() waits for the loop to end its turn before cancelling it.
STOP_S = 5.0


def consumer_name() -> str:
    """This process's name in the group: its host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


def backoff_s(failures: int, first_s: float, max_s: float) -> float:
    """The wait after the ``failures``-th failed attempt: ``first_s`` doubling,
    capped at ``max_s``, then jittered down by up to half, so the retries of
    many events failed at once spread out."""
    wait = min(max_s, first_s * 2.0 ** min(failures - 1, 62))
    return wait * random.uniform(0.5, 1.0)


@dataclass(frozen=True)
class Event:
    """One outbox entry: where it is (stream and entry id) and what it holds."""

    stream: str
    entry_id: str
    id: str
    type: str
    data: str
    url: str | None

    @classmethod
    def of(cls, stream: str, entry_id: Any, fields: dict[Any, Any]) -> Event:
        text = {_s(k): _s(v) for k, v in fields.items()}
        return cls(stream, _s(entry_id), text.get("id") or f"msg_{_s(entry_id)}",
                   text.get("type", ""), text.get("data", "null"), text.get("url") or None)

    @property
    def member(self) -> str:
        """Its member in the schedule: the entry id first (it holds no space)."""
        return f"{self.entry_id} {self.stream}"


@dataclass(frozen=True)
class Outcome:
    """One attempt: the receiver's HTTP status, or why there was none."""

    status: int | None
    error: str

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


class Deliverer:
    """Delivers webhook events from the outboxes until ``stop()``.

    ``claim_idle_s``: how long a read entry may sit untouched (no attempt
    running, none scheduled) before another deliverer takes it over; longer
    than an attempt (``webhook_timeout_s``). ``poll_s``: the wait between two
    looks at the outboxes when nothing is due; ``discover_s``: between two
    listings of the queues' outboxes (a queue's first job event waits for one).
    """

    def __init__(self, redis: Any, keys: Keys, settings: Settings, *,
                 consumer: str | None = None, claim_idle_s: float | None = None,
                 poll_s: float = 0.5, discover_s: float = DISCOVER_S) -> None:
        self.redis, self.keys, self.settings = redis, keys, settings
        self.consumer = consumer or consumer_name()
        self.claim_idle_s = claim_idle_s or max(60.0, 3 * settings.webhook_timeout_s)
        self.poll_s, self.discover_s = poll_s, discover_s
        self._key = secret_key(settings.webhook_secret) if settings.webhook_secret else None
        self._http: httpx.AsyncClient | None = None
        self._streams: list[str] = []
        self._grouped: set[str] = set()
        self._discovered = self._reclaimed = float("-inf")
        self._running: dict[str, asyncio.Task[None]] = {}  # member -> its attempt
        self._freed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._turn = 0  # which outbox _read_new reads first
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
        """Stop reading; attempts under way are cancelled (their entries stay
        pending, or scheduled, for this or another deliverer to finish)."""
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
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

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
        """Start what is due: reclaimed entries, scheduled retries, new events,
        as far as free slots allow; True when any started."""
        now = time.monotonic()
        full = now - self._discovered >= self.discover_s
        if full or self.keys.webhook_outbox not in self._grouped:
            await self._discover(full)
            if full:
                self._discovered = now
        started = 0
        if now - self._reclaimed >= self.claim_idle_s / 2:
            self._reclaimed = now
            started += await self._reclaim()
        started += await self._due()
        started += await self._read_new()
        return started > 0

    @property
    def _free(self) -> int:
        return self.settings.webhook_concurrency - len(self._running)

    async def _discover(self, full: bool) -> None:
        """Join the group of each outbox that exists (the fleet's, and with
        ``full`` each queue's, listed again). A stream is not made here: a
        fleet that sends no webhooks keeps no keys for them."""
        streams = {self.keys.webhook_outbox, *self._streams}
        if full:
            async for key in self.redis.scan_iter(match=self.keys.job_webhooks_pattern(),
                                                  count=500):
                streams.add(_s(key))
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
        """New events, as many as free slots take: one stream after another
        (each on its own node of a cluster), starting one further each pass so
        that a busy outbox does not keep the others waiting."""
        started = 0
        self._turn += 1
        for i in range(len(self._streams)):
            if self._free <= 0:
                break
            stream = self._streams[(self._turn + i) % len(self._streams)]
            reply = await self.redis.xreadgroup(GROUP, self.consumer, {stream: ">"},
                                                count=self._free)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._begin(Event.of(stream, entry_id, fields))
                    started += 1
        return started

    async def _due(self) -> int:
        """Scheduled retries whose time has come: each taken by the one
        deliverer whose ZREM removes it, then claimed in the group."""
        if self._free <= 0:
            return 0
        due = await self.redis.zrangebyscore(self.keys.webhook_schedule, "-inf", time.time(),
                                             start=0, num=self._free)
        started = 0
        for raw in due:
            member = _s(raw)
            if member in self._running or not await self.redis.zrem(
                    self.keys.webhook_schedule, member):
                continue  # another deliverer took it
            entry_id, _, stream = member.partition(" ")
            claimed = await self.redis.xclaim(stream, GROUP, self.consumer, 0, [entry_id])
            for one_id, fields in claimed or []:
                if fields:  # an entry deleted meanwhile comes back empty
                    self._begin(Event.of(stream, one_id, fields))
                    started += 1
        return started

    async def _reclaim(self) -> int:
        """Take over entries a dead deliverer read and left: idle past
        ``claim_idle_s`` and neither scheduled nor being posted here."""
        started = 0
        idle_ms = int(self.claim_idle_s * 1000)
        for stream in self._streams:
            cursor = "0-0"
            while self._free > 0:
                reply = await self.redis.xautoclaim(stream, GROUP, self.consumer, idle_ms,
                                                    start_id=cursor, count=100)
                cursor = _s(reply[0])
                events = [Event.of(stream, entry_id, fields)
                          for entry_id, fields in reply[1] if fields]
                pipe = self.redis.pipeline(transaction=False)
                for event in events:
                    pipe.zscore(self.keys.webhook_schedule, event.member)
                scheduled = await pipe.execute() if events else []
                for event, when in zip(events, scheduled):
                    if when is not None or event.member in self._running:
                        continue  # waiting for its retry: the schedule owns it
                    log.info("webhook deliverer: took over %s (%s) left by another", event.id,
                             event.type)
                    self._begin(event)
                    started += 1
                if cursor == "0-0":
                    break
        return started

    # -- one attempt --------------------------------------------------------------------

    def _begin(self, event: Event) -> None:
        task = asyncio.create_task(self._attempt(event), name=f"webhook {event.id}")
        self._running[event.member] = task
        task.add_done_callback(lambda _: self._done(event.member))

    def _done(self, member: str) -> None:
        self._running.pop(member, None)
        self._freed.set()

    async def _attempt(self, event: Event) -> None:
        try:
            url = event.url or self.settings.webhook_url
            if not url:  # no webhook was asked for (a batch's end in a fleet without any)
                log.debug("webhook event %s (%s) dropped: it names no URL and "
                          "TOKENFLEET_WEBHOOK_URL is not set", event.id, event.type)
                self.outcomes["dropped"] += 1
                await self._forget(event)
                return
            problem = webhook_url_problem(url)
            if problem:  # no attempt could ever land: given up at once, with the reason
                await self._dead(event, url, 0, Outcome(None, problem))
                return
            if self._key is None:
                self._warn_once("no-secret", "webhook events go out unsigned: set "
                                "TOKENFLEET_WEBHOOK_SECRET so receivers can verify them")
            payload = body(event.type, event_time(event.entry_id), event.data)
            outcome = await self._http_post(url, payload, headers(event.id, int(time.time()),
                                                             payload, self._key))
            await self._record(event, url, outcome)
        except asyncio.CancelledError:
            raise
        except Exception:  # the entry stays pending: another pass or deliverer retries it
            log.exception("webhook deliverer: attempt at %s failed", event.id)

    async def _http_post(self, url: str, payload: bytes, head: dict[str, str]) -> Outcome:
        if self._http is None:
            limits = httpx.Limits(max_connections=self.settings.webhook_concurrency)
            self._http = httpx.AsyncClient(timeout=self.settings.webhook_timeout_s,
                                           limits=limits, follow_redirects=False)
        try:
            answer = await self._http.post(url, content=payload, headers=head)
        except httpx.HTTPError as exc:
            return Outcome(None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR] or type(exc).__name__)
        if 200 <= answer.status_code < 300:
            return Outcome(answer.status_code, "")
        return Outcome(answer.status_code,
                       f"HTTP {answer.status_code}: {answer.text[:200]}"[:MAX_ERROR])

    async def _record(self, event: Event, url: str, outcome: Outcome) -> None:
        """Store the attempt; then acknowledge, schedule the next, or give up."""
        now = time.time()
        state = self.keys.webhook_event(event.id)
        attempt = {"id": event.id, "type": event.type, "url": url, "at": repr(now),
                   "status": "" if outcome.status is None else str(outcome.status),
                   "error": outcome.error, "deliverer": self.consumer}
        if outcome.delivered:
            self.outcomes["delivered"] += 1
            await self._forget(event, attempt)
            return
        failures = await self.redis.hincrby(state, "attempts", 1)
        await self.redis.xadd(self.keys.webhook_attempts, attempt, maxlen=ATTEMPTS_KEPT,
                              approximate=True)
        await self.redis.hsetnx(state, "first_failed_at", repr(now))
        first = float(_s(await self.redis.hget(state, "first_failed_at") or repr(now)))
        wait = backoff_s(failures, self.settings.webhook_backoff_s,
                         self.settings.webhook_backoff_max_s)
        if now + wait > first + self.settings.webhook_retry_s:
            await self._dead(event, url, failures, outcome)
            return
        self.outcomes["failed"] += 1
        await self.redis.hset(state, mapping={
            "type": event.type, "url": url, "stream": event.stream, "entry": event.entry_id,
            "last_status": "" if outcome.status is None else str(outcome.status),
            "last_error": outcome.error, "last_at": repr(now), "next_at": repr(now + wait)})
        # Kept a day past the last retry, should the entry vanish without a word.
        await self.redis.expire(state, int(self.settings.webhook_retry_s + 86_400))
        # Scheduled last: until this lands the entry is only pending, which a
        # crash leaves to the reclaim (an attempt early, never one lost).
        await self.redis.zadd(self.keys.webhook_schedule, {event.member: now + wait})

    async def _dead(self, event: Event, url: str, attempts: int, outcome: Outcome) -> None:
        log.warning("webhook %s (%s) to %s given up after %d failed attempts (last: %s): "
                    "moved to %s", event.id, event.type, url, attempts, outcome.error,
                    self.keys.webhook_dead)
        await self.redis.xadd(self.keys.webhook_dead, {
            "id": event.id, "type": event.type, "data": event.data, "url": url,
            "attempts": str(attempts), "last_status": "" if outcome.status is None
            else str(outcome.status), "last_error": outcome.error, "at": repr(time.time()),
            "stream": event.stream, "entry": event.entry_id})
        self.outcomes["dead"] += 1
        await self._forget(event)

    async def _forget(self, event: Event, attempt: dict[str, str] | None = None) -> None:
        """Acknowledge and delete the entry, then its retry state (and record
        the ``attempt`` that delivered it): one round trip. Should the cleanup
        be lost, a retry due finds no entry, and the state's TTL ends it."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(event.stream, GROUP, event.entry_id)
        pipe.xdel(event.stream, event.entry_id)
        pipe.zrem(self.keys.webhook_schedule, event.member)
        pipe.delete(self.keys.webhook_event(event.id))
        if attempt is not None:
            pipe.xadd(self.keys.webhook_attempts, attempt, maxlen=ATTEMPTS_KEPT, approximate=True)
        await pipe.execute()

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
