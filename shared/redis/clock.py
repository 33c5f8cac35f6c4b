"""The fleet's one clock: Redis's ``TIME``, read now and then and carried forward
on this host's monotonic clock.

Every time that one process writes and another judges (a worker's
``alive_until``, a job's ``deadline_at``, ``started_at``, ``finished_at``) is a
time on this clock, so that hosts whose own clocks disagree by minutes still
agree on who is live and when a deadline passes. The host's wall clock is never
read: between readings of ``TIME`` the time moves on by the host's monotonic
clock, which a step of the wall clock (an NTP correction, an operator's
``date -s``) does not move. A reading is taken again when it is ``max_age_s``
old, which bounds the drift of the two clocks' rates (ppm) to milliseconds.

A reading is as good as its round trip: ``TIME`` was answered somewhere between
the request and the reply, and the reading stands for the moment the reply came
in, so this clock is never ahead of Redis's (a deadline is never judged passed
early) and lags it by at most the round trip. A later reading replaces it only
if its round trip was no slower or the old one is stale: one slow reply does
not hold the clock back by its length.

On a Redis Cluster ``TIME`` goes to the client's default node: one node's clock;
when that node does not answer, another master's. A reading that cannot be
renewed (Redis out of reach) carries on: the monotonic clock keeps it right.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisClusterException, RedisError

log = logging.getLogger(__name__)

# How old a reading may be before the next ``now`` reads ``TIME`` again.
MAX_AGE_S = 30.0
# A node that did not answer TIME (a dead Cluster node among them).
_UNANSWERED = (RedisError, RedisClusterException, OSError)


class _SyncTime(Protocol):
    def time(self) -> Any: ...


@dataclass(frozen=True)
class _Reading:
    redis_s: float  # Redis's TIME, in seconds
    at: float  # the monotonic time it stands for: when the reply came in
    round_trip_s: float


class FleetClock:
    """Redis's clock in this process: ``now()`` is Redis's ``TIME`` as of now.

    ``read(redis)`` (or ``await aread(redis)``) returns the time, asking Redis
    first when no reading is fresh; ``now()`` never does I/O and answers from
    the last reading, or from ``fallback`` before the first one (a process
    that has not reached Redis yet has nothing to judge against it either).
    Thread-safe: a reading is replaced whole.
    """

    def __init__(self, max_age_s: float = MAX_AGE_S,
                 monotonic: Callable[[], float] = time.monotonic,
                 fallback: Callable[[], float] = time.time) -> None:
        self.max_age_s = max_age_s
        self._monotonic = monotonic
        self._fallback = fallback
        self._reading: _Reading | None = None

    @property
    def due(self) -> bool:
        """Whether the next ``read`` asks Redis: no reading yet, or a stale one."""
        reading = self._reading
        return reading is None or self._monotonic() - reading.at >= self.max_age_s

    def now(self) -> float:
        """Redis's time now, from the last reading; no I/O."""
        reading = self._reading
        if reading is None:
            return self._fallback()
        return reading.redis_s + (self._monotonic() - reading.at)

    def read(self, redis: _SyncTime) -> float:
        """Redis's time now, reading ``TIME`` first if the last reading is stale
        (a failed re-reading keeps the last one; with none, it raises)."""
        if self.due:
            try:
                self.sync(redis)
            except _UNANSWERED as exc:
                if self._reading is None:
                    raise
                log.warning("reading Redis's clock failed (%s); the last reading carries on",
                            exc)
        return self.now()

    async def aread(self, redis: Any) -> float:
        """``read`` for an asyncio client."""
        if self.due:
            sent = self._monotonic()
            try:
                reply = await _ask_async(redis)
            except _UNANSWERED as exc:
                if self._reading is None:
                    raise
                log.warning("reading Redis's clock failed (%s); the last reading carries on",
                            exc)
            else:
                self.record(reply, sent, self._monotonic())
        return self.now()

    def sync(self, redis: _SyncTime) -> None:
        """Read ``TIME`` now, whatever the age of the last reading."""
        sent = self._monotonic()
        reply = _ask(redis)
        self.record(reply, sent, self._monotonic())

    def record(self, reply: Any, sent: float, received: float) -> None:
        """Take a ``TIME`` reply (seconds, microseconds) asked for at monotonic
        ``sent`` and answered at ``received``."""
        seconds, micros = reply
        reading = _Reading(int(seconds) + int(micros) / 1e6, received, received - sent)
        old = self._reading
        if (old is None or reading.round_trip_s <= old.round_trip_s
                or reading.at - old.at >= self.max_age_s):
            self._reading = reading


def redis_now(redis: _SyncTime) -> float:
    """Redis's time now, read once: for a process that judges once (a CLI read)."""
    seconds, micros = _ask(redis)
    return int(seconds) + int(micros) / 1e6


def _places(redis: Any) -> list[dict[str, Any]]:
    """Where to ask ``TIME``, in turn: the client's default node, then, on a
    Cluster, each master (the default one may be dead)."""
    primaries = getattr(redis, "get_primaries", None)
    return [{}, *({"target_nodes": node} for node in (primaries() if primaries else []))]


def _ask(redis: Any) -> Any:
    """``TIME`` from the first place that answers; the default node's error if none does."""
    first: BaseException | None = None
    for where in _places(redis):
        try:
            return redis.time(**where)
        except _UNANSWERED as exc:
            first = first or exc
    assert first is not None
    raise first


async def _ask_async(redis: Any) -> Any:
    first: BaseException | None = None
    for where in _places(redis):
        try:
            return await redis.time(**where)
        except _UNANSWERED as exc:
            first = first or exc
    assert first is not None
    raise first
