"""The feeder: reads a queue's streams through the consumer group, with credits.

A worker asks for at most ``credits`` entries: its free batch slots plus
``prefetch``. So it never hoards jobs another worker could start now, and the
engine never waits on Redis for its next prefill. On start it first re-reads
its own pending entries (a restarted process resumes what it had). Every
heartbeat period it takes over the pending entries of consumers the queue's
served set no longer lists as live (``tokenfleet.shared.redis.liveness``): a dead
worker's jobs resume as soon as its liveness lapses. And now and then it
reclaims any entry left idle for ``claim_idle_s``, whoever holds it (a worker
live by its heartbeat whose engine is stuck).

Priorities: each level (high, normal, low, batch) has streams of its own. The
live levels' credits are dealt in turns from the cycle ``TURNS``: of every 7
jobs a busy worker takes, 4 come from high, 2 from normal and 1 from low, so a
flood of high-priority work slows the lower levels but never stops them. A
level with nothing waiting leaves its turns to the others, highest first.

The batch level is read last and apart, for ``batch_credits`` only: the batch
slots free once the live levels' entries of the same pass are taken, never
prefetch, so no batch job waits in the worker where a live one could start.
With preemption on, the live levels' credits count the slots batch jobs hold
as free: live entries are read while batch jobs run, and the worker hands those
back for them (``tokenfleet.workers.preemption``).

Tenants: within a level, each named tenant has a stream of its own
(``tokenfleet.workers.fair_share``). With fair share on, a level's credits go
to its tenants by weighted virtual tokens served, counted fleet-wide in Redis
(``fair.lua``); off, the default tenant's stream is read first and the others'
in turn after it.

Partitions: a feeder reads one partition of its queue (or the queue itself,
of one partition). A worker serving a queue of P partitions runs P feeders,
which read in turns against the worker's one count of credits
(``tokenfleet.workers.shared_credits``).

What it reads goes to the intake (``tokenfleet.workers.intake``), which owns,
checks and hands over each entry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from tokenfleet.shared.redis import liveness
from tokenfleet.shared.wire.keys import BATCH, GROUP, LIVE_PRIORITIES, PRIORITIES, Keys, level_priority
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.admission import Admission
from tokenfleet.workers.affinity import Affinity
from tokenfleet.workers.fair_share import TenantStreams
from tokenfleet.workers.intake import Intake
from tokenfleet.workers.publisher import Publisher
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.shared_credits import SharedCredits

log = logging.getLogger(__name__)

TURNS = ("high", "normal", "high", "low", "high", "normal", "high")


class Turns:
    """Deals credits to priority levels in the order of ``TURNS``, round after round."""

    def __init__(self) -> None:
        self._next = 0

    def deal(self, credits: int) -> dict[str, int]:
        shares = dict.fromkeys(PRIORITIES, 0)
        for i in range(credits):
            shares[TURNS[(self._next + i) % len(TURNS)]] += 1
        self._next = (self._next + credits) % len(TURNS)
        return shares


class Feeder:
    def __init__(
        self,
        redis: Any,
        keys: Keys,
        settings: Settings,
        consumer: str,
        queue: str,
        admission: Admission,
        publisher: Publisher,
        sink: Callable[[list[Sequence]], None],
        credits: Callable[[], int],
        holds: Callable[[str], bool] = lambda job_id: False,
        batch_credits: Callable[[], int] = lambda: 0,
        shared: SharedCredits | None = None,
        paused: threading.Event | None = None,
        slots_freed: threading.Event | None = None,
        slots: int = 1,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.consumer = consumer
        self.queue = queue
        self.tenant_streams = TenantStreams(redis, keys, settings, queue, consumer)
        self.turns = Turns()
        # Fewer credits than this: wait for more. Below half the prefetch, every
        # free batch slot still has a job waiting for it, so reading in pairs
        # (not one by one) starves nothing and halves the reads under load.
        self._least = max(1, settings.prefetch // 2)
        self.admission = admission
        self.credits = credits
        self.batch_credits = batch_credits
        # Placement by prefix: this worker's own streams, read first, and its peers'.
        self.affinity = (Affinity(redis, keys, settings, consumer, queue, slots,
                                  publisher.fleet_clock) if settings.affinity else None)
        self.intake = Intake(redis, keys, settings, consumer, queue, admission, publisher,
                             sink, holds, self.affinity.note_held if self.affinity else None)
        self.take = self.intake.take
        # The feeders of one worker's partitions share these: the credits they
        # read against, the wake-up when slots free, the pause.
        self.shared = shared or SharedCredits([queue])
        self.slots_freed = slots_freed or threading.Event()
        self.paused = paused or threading.Event()  # set: read nothing new (drain)
        self._last_reclaim = 0.0
        self._last_dead_check = 0.0

    @property
    def levels(self) -> list[tuple[str, str]]:
        """(queue name, stream) of every level and tenant, highest priority first,
        then every worker's own streams."""
        owned = self.affinity.levels() if self.affinity else []
        return self.tenant_streams.levels() + owned

    @property
    def live_levels(self) -> list[tuple[str, str]]:
        """(queue name, stream) of every live level (not batch) and tenant."""
        return self.tenant_streams.levels(LIVE_PRIORITIES)

    def ensure_group(self) -> None:
        self.tenant_streams.ensure_groups()
        self.tenant_streams.refresh(force=True)
        if self.affinity:
            self.affinity.ensure_groups()

    def run(self, stop: threading.Event) -> None:
        backoff = 0.05
        starting = True  # make the group, then re-take this consumer's own pending entries
        regroup = False  # after a lost connection: make the group again if Redis lost it
        while not stop.is_set():
            try:
                if starting or regroup:
                    self.ensure_group()
                if starting:
                    with self.shared:
                        self._take_own_pending()
                starting = regroup = False
                self._feed_once()
                backoff = 0.05
            except (ConnectionError, TimeoutError, OSError) as exc:
                log.warning("redis unavailable for the feeder (%s); retrying in %.2fs", exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                # The entries this process already holds stay with its engine:
                # re-taking them would fence its own attempts.
                regroup = True
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    # Redis came back without the stream (no persistence): make it again.
                    log.warning("consumer group gone (%s); creating it again", exc)
                    regroup = True
                else:
                    log.exception("feeder error")
                    stop.wait(0.5)
            except Exception:  # never let one bad batch stop the intake
                log.exception("feeder error")
                stop.wait(0.5)

    def _feed_once(self) -> None:
        with self.shared:
            turn = self._read_turn()
        if turn is None:
            self.slots_freed.wait(0.05)
            self.slots_freed.clear()
            return
        got, room = turn
        if not got:
            # Nothing anywhere: block on every stream at once until something
            # comes (the batch level's only while a slot is free for it). A
            # tenant new to the queue is not in that read: look for one after it.
            levels = self.tenant_streams.levels() if room > 0 else self.live_levels
            block = self.settings.block_ms
            if self.affinity:
                levels += self.affinity.own()
                block = max(1, round(self.affinity.wait_s(block / 1000) * 1000))
            taken = self._read({stream: 1 for _name, stream in levels}, block=block)
            if not any(taken.values()):
                self.tenant_streams.refresh(force=True)
                if self.affinity:  # a stream made for this worker since: read within a second
                    self.affinity.refresh()

    def _read_turn(self) -> tuple[int, int] | None:
        """This partition's turn at the credits: how many entries it read and the
        batch level's room; None when too few credits are left (or paused)."""
        credits = self.credits()
        if credits < self._least or self.paused.is_set():
            return None
        credits = self.shared.share(self.queue, credits)
        if credits <= 0:
            return None  # the credits free now fall to other partitions
        now = time.monotonic()
        idle_due = now - self._last_reclaim >= self.settings.claim_idle_s / 2
        dead_due = now - self._last_dead_check >= min(self.settings.heartbeat_s,
                                                      self.settings.claim_idle_s / 2)
        if idle_due or dead_due:
            self._last_dead_check = now
            if idle_due:
                self._last_reclaim = now
            if self._reclaim(credits, idle=idle_due):
                self.shared.found(self.queue, 1)
                return 1, 0
        self.tenant_streams.refresh()
        got = self._read_own(credits) if self.affinity else 0
        if got < credits:
            got += self._read_levels(self.turns.deal(credits - got), credits - got,
                                     LIVE_PRIORITIES)
        # Taken from a peer only to start now, in a free slot: to wait here in the
        # prefetch instead of there would lose its prefix and gain nothing.
        free = min(credits - got, self.batch_credits())
        if self.affinity and free > 0 and self.affinity.steal_due():
            for level, entries in self.affinity.steal(free):
                self.take(level, entries)
                got += len(entries)
        # Asked after the live entries were handed over: they hold their slots now.
        room = self.shared.share(self.queue, self.batch_credits())
        if room > 0:
            got += self._read_levels({BATCH: room}, room, (BATCH,))
        self.shared.found(self.queue, got)
        return got, room

    def _read_own(self, credits: int) -> int:
        """Read this worker's own streams (placement by prefix) first, highest
        priority first: the jobs placed here for the prefixes it holds."""
        assert self.affinity is not None
        self.affinity.refresh()
        got = 0
        for _level, stream in self.affinity.own():
            if got >= credits:
                break
            got += self._read({stream: credits - got})[stream]
        return got

    def _read_levels(self, shares: dict[str, int], credits: int,
                     priorities: tuple[str, ...]) -> int:
        """Read ``shares`` (credits per level) from the levels of ``priorities``,
        a level's shortfall going to the next; returns how many came."""
        if self.settings.fair_share:
            got = 0
            for stream, entries in self.tenant_streams.read_fair(shares, priorities):
                self.take(self.keys.queue_of(stream), entries)
                got += len(entries)
            return got
        return self._read_in_turn(shares, credits, priorities)

    def _read_in_turn(self, shares: dict[str, int], credits: int,
                      priorities: tuple[str, ...]) -> int:
        """Fair share off: each level's share from its default tenant's stream,
        then the shortfall from every stream, highest level first (one read each)."""
        asked = {self.tenant_streams.streams_of(p)[0]: n for p, n in shares.items()
                 if n and p in priorities}
        got = self._read(asked)
        short = credits - sum(got.values())
        # A stream that gave less than it was asked is empty now.
        for _name, stream in self.tenant_streams.levels(priorities):
            if short <= 0:
                break
            if got.get(stream, 0) < asked.get(stream, 0):
                continue
            taken = self._read({stream: short})
            got[stream] = got.get(stream, 0) + taken[stream]
            short -= taken[stream]
        return sum(got.values())

    def _read(self, counts: dict[str, int], block: int | None = None) -> dict[str, int]:
        """XREADGROUP ``count`` new entries from each stream; hand them over;
        return how many came from each."""
        taken = dict.fromkeys(counts, 0)
        if not counts:
            return taken
        if block is None and len(counts) > 1:
            pipe = self.redis.pipeline(transaction=False)
            for stream, count in counts.items():
                pipe.xreadgroup(GROUP, self.consumer, {stream: ">"}, count=count)
            replies = [reply for result in pipe.execute() for reply in result or []]
        else:
            count = max(counts.values())
            replies = self.redis.xreadgroup(GROUP, self.consumer, dict.fromkeys(counts, ">"),
                                            count=count, block=block) or []
        with self.shared:  # a blocking read's entries are handed over in a turn too
            for raw_stream, entries in replies:
                stream = raw_stream.decode()
                self.take(self.keys.queue_of(stream), entries)
                taken[stream] += len(entries)
            if block is not None and any(taken.values()):
                self.shared.found(self.queue, sum(taken.values()))
        return taken

    def _take_own_pending(self) -> None:
        """Entries this consumer name held when its process died: run them again."""
        for name, stream in self.levels:
            start = "0"
            while True:
                reply = self.redis.xreadgroup(GROUP, self.consumer, {stream: start}, count=100)
                entries = reply[0][1] if reply else []
                if not entries:
                    break
                self.take(name, entries)
                start = entries[-1][0]

    def _reclaim(self, credits: int, idle: bool = True) -> bool:
        """Take over the entries of dead consumers, and with ``idle`` those left
        idle for ``claim_idle_s``; True if any came.

        A consumer is dead once the queue's served set no longer lists it as
        live: its heartbeat's ``alive_until`` has passed on Redis's clock (or
        it left). Its entries are taken at once, not after ``claim_idle_s``: a
        crashed worker's streams stall only until its liveness lapses. A
        worker frozen, not dead, that wakes after its entries were taken is
        fenced by the new attempt (start.lua): its late writes change nothing.
        A worker lists itself before it reads (``Worker.start``), so a
        live one's entries are never taken for a dead one's; even so an entry
        is taken only once idle for a heartbeat period, the least time a live
        consumer's could have been untouched.

        The idle entries are listed (XPENDING ... IDLE) and only those this
        worker does not run are claimed. An entry this worker runs goes idle
        only when the heartbeat, which touches it every ``heartbeat_s``, could
        not (Redis away, a stall). Claiming it to ourselves would change
        nothing but its delivery count, again at every pass; starting it again
        would fence our own attempt. So it is left alone: the heartbeat owns
        its liveness, and if this worker really is stuck, another worker's
        reclaim takes the entry (for it, it is a dead consumer's) and fences
        this one, which is the recovery we want.
        """
        idle_ms = int(self.settings.claim_idle_s * 1000)
        dead_idle_ms = min(idle_ms, int(self.settings.heartbeat_s * 1000))
        levels = [(name, stream, self.batch_credits() if level_priority(name) == BATCH
                   else credits) for name, stream in self.levels]
        # A batch entry only for a free slot, as when it is read.
        levels = [(name, stream, most) for name, stream, most in levels if most > 0]
        if not levels:
            return False
        dead = self._dead_holders([stream for _name, stream, _most in levels])
        found = False
        for name, stream, most in levels:
            mine = self.intake.running_entries(stream)
            ids: list[Any] = []
            for consumer in dead.get(stream, []):
                pending = self.redis.xpending_range(stream, GROUP, min="-", max="+",
                                                    count=most - len(ids), idle=dead_idle_ms,
                                                    consumername=consumer)
                ids += [p["message_id"] for p in pending if p["message_id"].decode() not in mine]
                if len(ids) >= most:
                    break
            if idle and len(ids) < most:
                pending = self.redis.xpending_range(stream, GROUP, min="-", max="+",
                                                    count=most + len(mine), idle=idle_ms)
                ids += [p["message_id"] for p in pending
                        if p["message_id"].decode() not in mine and p["message_id"] not in ids]
            ids = ids[:most]
            if not ids:
                continue
            # With the idle time again: an entry another worker claimed since
            # the listing has a fresh idle time and stays with it.
            entries = self.redis.xclaim(stream, GROUP, self.consumer, dead_idle_ms, ids)
            if entries:
                log.info("reclaimed %d entries of %s", len(entries), stream)
                self.take(name, entries)
                found = True
        return found

    def _dead_holders(self, streams: list[str]) -> dict[str, list[str]]:
        """The consumers holding pending entries of each stream that the
        queue's served set does not list as live (this one never)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(self.keys.queue_workers(self.queue),
                           liveness.live_since(self.intake.publisher.fleet_clock.now()), "+inf")
        for stream in streams:
            pipe.xpending(stream, GROUP)
        live, *summaries = pipe.execute(raise_on_error=False)
        if isinstance(live, Exception):
            raise live
        live = {m.decode() for m in live} | {self.consumer}
        dead: dict[str, list[str]] = {}
        for stream, summary in zip(streams, summaries):
            if isinstance(summary, Exception):
                continue  # no such stream (yet): nothing pending in it
            dead[stream] = [c["name"].decode() for c in summary.get("consumers") or []
                            if c["name"].decode() not in live]
        return dead
