"""Each tenant's webhook events waiting for delivery, in Redis: its lane.

A lane (``Keys.webhook_lane``) is a sorted set of event ids scored by when each
is due: a new event by its arrival, a failed one by its next attempt, one being
posted by the end of its lease. The event itself (type, data, URL, tenant,
attempts so far) is a hash (``Keys.webhook_event``); the tenants whose lane may
hold events are a set (``Keys.webhook_lanes``). Deliverers take the lanes in
turn (``webhook_delivery``), so one tenant's backlog never stands in front of
another's. A lane holds at most ``webhook_tenant_queued`` events, and a
tenant's dead letters (``Keys.webhook_dead_of``) keep its newest
``webhook_tenant_dead``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.wire.keys import DEFAULT_TENANT, Keys
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.webhook_scripts import webhook_take
from tokenfleet.webhooks.connect import Outcome

log = logging.getLogger("tokenfleet.webhooks")

# Lines the attempts stream keeps (approximately: MAXLEN ~).
ATTEMPTS_KEPT = 10_000


@dataclass(frozen=True)
class Event:
    """One event: its id (the ``webhook-id``), type, JSON payload, own URL,
    tenant, and the outbox entry it came from (whose id tells its time)."""

    id: str
    type: str
    data: str
    url: str | None
    tenant: str
    entry: str

    @classmethod
    def of(cls, entry_id: Any, fields: dict[Any, Any]) -> Event:
        """The event of an outbox entry, or of its hash in ``Keys.webhook_event``."""
        text = {as_text(k): as_text(v) for k, v in fields.items()}
        entry = text.get("entry") or as_text(entry_id)
        return cls(text.get("id") or f"msg_{entry}", text.get("type", ""),
                   text.get("data", "null"), text.get("url") or None,
                   text.get("tenant") or DEFAULT_TENANT, entry)

    def fields(self) -> dict[str, str]:
        return {"id": self.id, "type": self.type, "data": self.data, "url": self.url or "",
                "tenant": self.tenant, "entry": self.entry}


class Lanes:
    """The lanes of one fleet, as one deliverer reads and writes them."""

    def __init__(self, redis: Any, keys: Keys, settings: Settings) -> None:
        self.redis, self.keys, self.settings = redis, keys, settings

    @property
    def _ttl_s(self) -> int:
        """An event's hash outlives its last retry by a day, should it vanish without a word."""
        return int(self.settings.webhook_retry_s + 86_400)

    async def intake(self, stream: str, group: str, entries: list[Any]) -> int:
        """Move outbox entries into their tenants' lanes (due now), or to the
        dead letters when the tenant's lane is full; then acknowledge and
        delete them, in the same round trip. A crash before that round trip
        leaves them pending, to be reclaimed; moving one twice changes nothing
        (its id is its member)."""
        if not entries:
            return 0
        ids = [as_text(entry_id) for entry_id, _ in entries]
        events = [Event.of(entry_id, fields) for entry_id, fields in entries if fields]
        tenants = sorted({e.tenant for e in events})
        pipe = self.redis.pipeline(transaction=False)
        for tenant in tenants:
            pipe.zcard(self.keys.webhook_lane(tenant))
        waiting = dict(zip(tenants, await pipe.execute() if tenants else []))
        cap, now = self.settings.webhook_tenant_queued, time.time()
        over: Counter[str] = Counter()
        pipe = self.redis.pipeline(transaction=False)
        for event in events:
            if waiting[event.tenant] >= cap:
                over[event.tenant] += 1
                self._add_dead(pipe, event, event.url or self.settings.webhook_url or "", 0,
                               Outcome(None, f"tenant {event.tenant!r} has {cap} webhook events "
                                       "waiting already, the limit "
                                       "(TOKENFLEET_WEBHOOK_TENANT_QUEUED)"))
                continue
            waiting[event.tenant] += 1
            state = self.keys.webhook_event(event.id)
            pipe.hset(state, mapping=event.fields())
            pipe.expire(state, self._ttl_s)
            pipe.zadd(self.keys.webhook_lane(event.tenant), {event.id: now}, nx=True)
        for tenant in tenants:
            pipe.sadd(self.keys.webhook_lanes, tenant)
        pipe.xack(stream, group, *ids)
        pipe.xdel(stream, *ids)
        await pipe.execute()
        for tenant, n in over.items():
            log.warning("webhook deliverer: %d event(s) of tenant %r went to its dead letters: "
                        "%d wait already (TOKENFLEET_WEBHOOK_TENANT_QUEUED)", n, tenant, cap)
        return len(entries)

    async def tenants(self) -> list[str]:
        return sorted(as_text(t) for t in await self.redis.smembers(self.keys.webhook_lanes))

    async def take(self, tenant: str, lease_s: float) -> tuple[bool, Event | None]:
        """Lease ``tenant``'s next due event for ``lease_s``: (False, None) when
        none is due; (True, None) when the one taken is gone (delivered by
        another meanwhile, or expired)."""
        now = time.time()
        taken = await webhook_take(self.keys, tenant, now=now, lease_until=now + lease_s,
                                   count=1).run_async(self.redis)
        if not taken:
            await self._drop_if_empty(tenant)
            return False, None
        fields = await self.redis.hgetall(self.keys.webhook_event(taken[0]))
        if not fields:
            await self.redis.zrem(self.keys.webhook_lane(tenant), taken[0])
            return True, None
        return True, Event.of("", fields)

    async def _drop_if_empty(self, tenant: str) -> None:
        """Forget an empty lane. An event moved in meanwhile adds the tenant
        after its ZADD, so a ZCARD after our SREM sees either the event (and the
        tenant goes back) or that SADD is still to come."""
        lane = self.keys.webhook_lane(tenant)
        if await self.redis.zcard(lane):
            return
        await self.redis.srem(self.keys.webhook_lanes, tenant)
        if await self.redis.zcard(lane):
            await self.redis.sadd(self.keys.webhook_lanes, tenant)

    async def failed(self, event: Event, attempt: dict[str, str], now: float
                     ) -> tuple[int, float]:
        """Record a failed attempt: the event's failures so far, and when the first was."""
        state = self.keys.webhook_event(event.id)
        failures = await self.redis.hincrby(state, "attempts", 1)
        await self.redis.xadd(self.keys.webhook_attempts, attempt, maxlen=ATTEMPTS_KEPT,
                              approximate=True)
        await self.redis.hsetnx(state, "first_failed_at", repr(now))
        first = float(as_text(await self.redis.hget(state, "first_failed_at") or repr(now)))
        return int(failures), first

    async def retry_at(self, event: Event, outcome: Outcome, now: float, at: float) -> None:
        """Schedule the event's next attempt at ``at``: its lease ends then."""
        state = self.keys.webhook_event(event.id)
        await self.redis.hset(state, mapping={
            "last_status": "" if outcome.status is None else str(outcome.status),
            "last_error": outcome.error, "last_at": repr(now), "next_at": repr(at)})
        await self.redis.expire(state, self._ttl_s)
        await self.redis.zadd(self.keys.webhook_lane(event.tenant), {event.id: at})

    async def hand_back(self, events: list[Event]) -> None:
        """Make events whose attempt was cut short due now (not at their lease's end)."""
        pipe = self.redis.pipeline(transaction=False)
        for event in events:
            pipe.zadd(self.keys.webhook_lane(event.tenant), {event.id: time.time()}, xx=True)
        await pipe.execute()

    def _add_dead(self, pipe: Any, event: Event, url: str, attempts: int,
                  outcome: Outcome) -> None:
        """Queue on ``pipe`` the dead letter of ``event``, in its tenant's list,
        which keeps the newest ``webhook_tenant_dead``."""
        pipe.xadd(self.keys.webhook_dead_of(event.tenant), {
            "id": event.id, "type": event.type, "data": event.data, "url": url,
            "tenant": event.tenant, "attempts": str(attempts),
            "last_status": "" if outcome.status is None else str(outcome.status),
            "last_error": outcome.error, "at": repr(time.time()), "entry": event.entry},
            maxlen=self.settings.webhook_tenant_dead, approximate=False)

    async def dead(self, event: Event, url: str, attempts: int, outcome: Outcome) -> None:
        """Give the event up: into its tenant's dead letters, out of its lane."""
        log.warning("webhook %s (%s) of tenant %r to %s given up after %d failed attempts "
                    "(last: %s): moved to %s", event.id, event.type, event.tenant, url,
                    attempts, outcome.error, self.keys.webhook_dead_of(event.tenant))
        # The dead letter and the lane's removal go out in one round trip: a
        # deliverer stopped in between would leave the event leased in its lane,
        # due again when the lease ends, and tried again (by a deliverer whose
        # allowlist may now admit it) though it is already a dead letter.
        pipe = self.redis.pipeline(transaction=False)
        self._add_dead(pipe, event, url, attempts, outcome)
        self._take_out(pipe, event)
        await pipe.execute()

    async def forget(self, event: Event, attempt: dict[str, str] | None = None) -> None:
        """Take the event out of its lane and delete it (and record the
        ``attempt`` that delivered it): one round trip. Should the cleanup be
        lost, the next take finds no event, and the state's TTL ends it."""
        pipe = self.redis.pipeline(transaction=False)
        self._take_out(pipe, event)
        if attempt is not None:
            pipe.xadd(self.keys.webhook_attempts, attempt, maxlen=ATTEMPTS_KEPT, approximate=True)
        await pipe.execute()

    def _take_out(self, pipe: Any, event: Event) -> None:
        pipe.zrem(self.keys.webhook_lane(event.tenant), event.id)
        pipe.delete(self.keys.webhook_event(event.id))


def as_text(value: Any) -> str:
    """A Redis reply (bytes) or a name as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
