"""Placement by prefix: a worker's own streams, and its peers'.

With ``TOKENFLEET_AFFINITY`` on, a job whose prompt starts as one a live worker
ran lately goes to that worker's own stream of its level and tenant
(``submit.lua``), where its prefix is likely still in the worker's cache. The
queue keeps its guarantees because an own stream is a stream like the shared
ones, in the same consumer group and the same slot:

- a worker lists itself among the partition's owners (``Keys.owners``: its tag,
  name and batch slots) and advertises the prefixes of the jobs it starts, the
  newest ``TOKENFLEET_AFFINITY_HELD`` (``Keys.held``, scored by when);
- it reads its own streams before the shared ones, and blocks on them too;
- a worker with a free slot steals from a peer's stream the entries that waited
  there ``TOKENFLEET_AFFINITY_STEAL_MS`` (``steal.lua``), so a hot prefix never
  queues behind one busy owner while another worker idles;
- a dead or departed owner's waiting entries are taken over at once, its pending
  ones are reclaimed as any dead consumer's are (the feeder's reclaim lists the
  owned streams with the shared ones), and once its streams are empty it is
  forgotten (``retire.lua``);
- a job handed back goes to the shared stream (``requeue.lua``).

What an owner holds is what it started, not what its cache kept: a prefix its
cache evicted still draws its jobs, which then compute it again there once.

Feeder thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import orjson

from tokenfleet.shared.redis import liveness
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.keys import (
    PRIORITIES,
    Keys,
    level_owner,
    level_priority,
    owner_tag,
)
from tokenfleet.shared.wire.topology import ensure_group
from tokenfleet.shared.wire.worker_scripts import StreamEntries, retire, steal

log = logging.getLogger(__name__)

# How often a feeder reads the partition's owners and owned streams again: a
# stream made for this worker since is read within this time (a blocking read
# that wakes for nothing looks again at once).
REFRESH_S = 1.0


class Affinity:
    """One worker's view of one partition's owners and their streams."""

    def __init__(self, redis: Any, keys: Keys, settings: Settings, consumer: str,
                 partition: str, slots: int, clock: Any) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self.partition = partition
        self.tag = owner_tag(consumer)
        self.slots = max(1, slots)
        self.clock = clock  # Redis's clock, as the heartbeats' scores are on it
        self.steal_ms = settings.affinity_steal_ms
        self.held_most = settings.affinity_held
        self._owners: dict[str, str] = {}  # tag -> worker name
        self._live: set[str] = set()  # the tags of live owners
        self._levels: list[str] = []  # the partition's owned levels
        self._refreshed = 0.0
        self._retired = 0.0  # monotonic time of the last look for owners to forget
        self._steal_at = 0.0  # monotonic time of the next look at peers' streams
        self._unheld = 0  # prefixes advertised since the held set was last trimmed

    # -- what this worker owns -----------------------------------------------------

    def register(self) -> None:
        """List this worker among the partition's owners (again after a peer
        forgot it while it was frozen, or Redis lost it)."""
        self.redis.hset(self.keys.owners(self.partition), self.tag,
                        orjson.dumps({"worker": self.consumer, "slots": self.slots}))

    def note_held(self, prefixes: Iterable[str]) -> None:
        """Advertise the prefixes of jobs this worker just started."""
        members = dict.fromkeys(prefixes, self.clock.now())
        if not members:
            return
        held = self.keys.held(self.partition, self.tag)
        self._unheld += len(members)
        if self._unheld < max(1, self.held_most // 8):
            self.redis.zadd(held, members)
            return
        # Trimmed now and then, not at each start: the set runs over by an eighth at most.
        self._unheld = 0
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(held, members)
        pipe.zremrangebyrank(held, 0, -self.held_most - 1)
        pipe.execute()

    # -- the owned streams -------------------------------------------------------

    def refresh(self, force: bool = False, every_s: float = REFRESH_S) -> None:
        """Read the owners, which are live, and the owned streams (when the last
        read is ``every_s`` old, or now with ``force``)."""
        now = time.monotonic()
        if not force and now - self._refreshed < every_s:
            return
        self._refreshed = now
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.owners(self.partition))
        pipe.smembers(self.keys.owned_levels(self.partition))
        pipe.zrangebyscore(self.keys.queue_workers(self.partition),
                           liveness.live_since(self.clock.now()), "+inf")
        owners, levels, live = pipe.execute()
        self._owners = {tag.decode(): _worker_of(info) for tag, info in owners.items()}
        live_names = {m.decode() for m in live} | {self.consumer}
        self._live = {tag for tag, name in self._owners.items() if name in live_names}
        self._levels = sorted((level.decode() for level in levels),
                              key=lambda level: (PRIORITIES.index(level_priority(level)), level))
        if self.tag not in self._owners:
            self.register()
            self._owners[self.tag] = self.consumer
            self._live.add(self.tag)
        # At most every REFRESH_S: a dead owner's streams empty once its peers
        # take them over, and the looks at peers' streams come far more often.
        if now - self._retired >= REFRESH_S:
            self._retired = now
            self._retire_dead()

    def ensure_groups(self) -> None:
        """The group on each owned stream (Redis may have lost them)."""
        self.refresh(force=True)
        for _level, stream in self.levels():
            ensure_group(self.redis, stream)

    def levels(self) -> list[tuple[str, str]]:
        """(level, stream) of every owned stream of the partition, this
        worker's and its peers': what a restart re-reads and a reclaim lists."""
        return [(level, self.keys.queue(level)) for level in self._levels]

    def own(self) -> list[tuple[str, str]]:
        """(level, stream) of this worker's own streams, highest priority first."""
        return [(level, stream) for level, stream in self.levels()
                if level_owner(level) == self.tag]

    # -- peers' streams ----------------------------------------------------------

    def steal_due(self) -> bool:
        """Whether to look at peers' streams now (for a worker with a free slot)."""
        return time.monotonic() >= self._steal_at

    def wait_s(self, block_s: float) -> float:
        """How long an idle read may block: until the next look at peers' streams
        (``block_s`` when none is due: a worker without a free slot does not look,
        and a past time would spin the read)."""
        left = self._steal_at - time.monotonic()
        return min(block_s, left) if left > 0 else block_s

    def steal(self, most: int) -> list[tuple[str, StreamEntries]]:
        """Take at most ``most`` entries from peers' streams: those that waited
        ``steal_ms`` behind a live owner, every waiting one of a dead owner's.
        Forgets the dead owners whose streams are empty."""
        # The streams a submit made since are seen within half the steal time.
        look_s = self.steal_ms / 2000
        self.refresh(every_s=look_s)
        peers = [(level, stream) for level, stream in self.levels()
                 if level_owner(level) != self.tag]
        if not peers:
            self._steal_at = time.monotonic() + look_s
            return []
        ages = [(stream, self.steal_ms if level_owner(level) in self._live else 0)
                for level, stream in peers]
        stolen = steal(ages, consumer=self.consumer, most=most).run(self.redis)
        # Look again when the oldest entry left could be old enough.
        wait_ms = stolen.due_ms if stolen.due_ms is not None else self.steal_ms / 2
        self._steal_at = time.monotonic() + wait_ms / 1000
        level_of = {stream: level for level, stream in peers}
        taken = [(level_of[stream], entries) for stream, entries in stolen.taken]
        if taken:
            log.info("took %d entries from other workers' streams (%s)",
                     sum(len(e) for _s, e in taken), ", ".join(lv for lv, _e in taken))
        return taken

    def _retire_dead(self) -> None:
        owning = {tag for level in self._levels if (tag := level_owner(level)) is not None}
        for tag in sorted((owning | set(self._owners)) - self._live):
            if retire(self.keys, partition=self.partition, tag=tag,
                      live_since=liveness.live_since(self.clock.now())).run(self.redis):
                log.info("forgot owner %s of %s: not live, its streams empty", tag,
                         self.partition)
                self._levels = [level for level in self._levels if level_owner(level) != tag]
                self._owners.pop(tag, None)


def _worker_of(info: bytes) -> str:
    """The worker an owner's entry names; '' for one that is not ours (never live:
    its streams are taken over and it is forgotten)."""
    try:
        found = orjson.loads(info)
    except orjson.JSONDecodeError:
        return ""
    worker = found.get("worker") if isinstance(found, dict) else None
    return worker if isinstance(worker, str) else ""
