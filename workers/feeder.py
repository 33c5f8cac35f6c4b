"""The intake: reads a queue's streams through the consumer group, with credits.

A worker asks for at most ``credits`` entries: its free batch slots plus
``prefetch``. So it never hoards jobs another worker could start now, and the
engine never waits on Redis for its next prefill. On start it first re-reads
its own pending entries (a restarted process resumes what it had), and now and
then it reclaims entries that a dead consumer left idle for ``claim_idle_s``.

Priorities: each level (high, normal, low) is a stream of its own. Credits are
dealt in turns from the cycle ``TURNS``: of every 7 jobs a busy worker takes, 4
come from high, 2 from normal and 1 from low, so a flood of high-priority work
slows the lower levels but never stops them. A level with nothing waiting
leaves its turns to the others, highest first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from tokenfleet.shared.keys import GROUP, PRIORITIES, Keys, level_queue
from tokenfleet.shared.schemas import FinishReason, JobStatus, QueueEntry
from tokenfleet.shared.scripts import Scripts
from tokenfleet.shared.serialization import loads
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.admission import Admission, Rejected
from tokenfleet.workers.publisher import Ending, Publisher
from tokenfleet.workers.sequence import Sequence

log = logging.getLogger(__name__)

Entry = tuple[bytes, dict[bytes, bytes] | None]

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
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.consumer = consumer
        self.queue = queue
        # (queue name of the level, its stream), highest priority first
        self.levels = [(level_queue(queue, p), keys.queue(level_queue(queue, p)))
                       for p in PRIORITIES]
        self.streams = {stream: name for name, stream in self.levels}
        self.turns = Turns()
        # Fewer credits than this: wait for more. Below half the prefetch, every
        # free batch slot still has a job waiting for it, so reading in pairs
        # (not one by one) starves nothing and halves the reads under load.
        self._least = max(1, settings.prefetch // 2)
        self.admission = admission
        self.publisher = publisher
        self.sink = sink
        self.credits = credits
        self.holds = holds
        self.scripts = Scripts(redis)
        self.slots_freed = threading.Event()
        self.paused = threading.Event()  # set: read nothing new (drain)
        self._last_reclaim = 0.0

    def ensure_group(self) -> None:
        for _name, stream in self.levels:
            try:
                # From the beginning: finished entries are deleted, so whatever
                # is still in the stream is waiting for a worker.
                self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def run(self, stop: threading.Event) -> None:
        backoff = 0.05
        starting = True  # make the group, then re-take this consumer's own pending entries
        regroup = False  # after a lost connection: make the group again if Redis lost it
        while not stop.is_set():
            try:
                if starting or regroup:
                    self.ensure_group()
                if starting:
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
        credits = self.credits()
        if credits < self._least or self.paused.is_set():
            self.slots_freed.wait(0.05)
            self.slots_freed.clear()
            return
        now = time.monotonic()
        if now - self._last_reclaim >= self.settings.claim_idle_s / 2:
            self._last_reclaim = now
            if self._reclaim(credits):
                return
        shares = self.turns.deal(credits)
        asked = {self.streams_of(p): n for p, n in shares.items() if n}
        got = self._read(asked)
        short = credits - sum(got.values())
        # A level that gave less than its turns is empty now; the rest of the
        # credits go to the other levels, highest first (one read each).
        for _name, stream in self.levels:
            if short <= 0:
                break
            if got.get(stream, 0) < asked.get(stream, 0):
                continue
            taken = self._read({stream: short})
            got[stream] = got.get(stream, 0) + taken[stream]
            short -= taken[stream]
        if not any(got.values()):
            # Nothing anywhere: block on every level at once until something comes.
            self._read({stream: 1 for _name, stream in self.levels},
                       block=self.settings.block_ms)

    def streams_of(self, priority: str) -> str:
        return self.keys.queue(level_queue(self.queue, priority))

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
        for raw_stream, entries in replies:
            stream = raw_stream.decode()
            self.take(self.streams[stream], entries)
            taken[stream] += len(entries)
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

    def _reclaim(self, credits: int) -> bool:
        """Take over entries a dead consumer left idle; True if any came."""
        idle_ms = int(self.settings.claim_idle_s * 1000)
        found = False
        for name, stream in self.levels:
            reply = self.redis.xautoclaim(stream, GROUP, self.consumer, idle_ms,
                                          start_id="0-0", count=credits)
            entries = reply[1] if reply else []
            if entries:
                log.info("reclaimed %d idle entries of %s", len(entries), stream)
                self.take(name, entries)
                found = True
        return found

    def take(self, queue: str, entries: list[Entry]) -> None:
        """Own, check and hand over entries read from the stream of ``queue``."""
        parsed: list[tuple[str, QueueEntry, bytes]] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            if fields is None:  # deleted while pending (a cancel): nothing left to run
                self.redis.xack(self.keys.queue(queue), GROUP, entry_id)
                continue
            try:
                data = fields[b"data"]
                entry = QueueEntry.model_validate_json(data)
            except (KeyError, ValueError, ValidationError) as exc:
                self.publisher.dead_letter(queue, entry_id, fields, _reason(exc))
                continue
            # Already running here (an entry of ours that XAUTOCLAIM found idle
            # through an outage): taking it again would fence our own attempt.
            if not self.holds(entry.job_id):
                parsed.append((entry_id, entry, data))
        if not parsed:
            return
        verdicts = self.scripts.start(
            keys=[self.keys.backlog(self.queue), *(self.keys.job(e.job_id) for _, e, _ in parsed)],
            args=[self.consumer, repr(time.time())],
        )
        ready: list[Sequence] = []
        endings: list[Ending] = []
        for (entry_id, entry, data), verdict in zip(parsed, verdicts):
            outcome = self._admit(queue, entry_id, entry, data, verdict)
            if isinstance(outcome, Sequence):
                ready.append(outcome)
            elif outcome is not None:
                endings.append(outcome)
        if endings:
            self.publisher.end(endings)
        if ready:
            self.sink(ready)

    def _admit(self, queue: str, entry_id: str, entry: QueueEntry, data: bytes,
               verdict: list[Any]) -> Sequence | Ending | None:
        status = verdict[0].decode()
        end = _EndingFor(queue, entry, entry_id)
        if status == "missing":
            self.publisher.dead_letter(queue, entry_id, {"data": entry.model_dump_json()},
                                       "no job record: it expired or was never written")
            return None
        if status != "run":
            return end(None, JobStatus(status))  # ended while queued: just acknowledge
        attempt, cancel, handbacks = int(verdict[1]), verdict[2] == b"1", int(verdict[3])
        if cancel:
            return end(attempt, JobStatus.CANCELLED, FinishReason.CANCELLED)
        if attempt - handbacks > self.settings.max_attempts:
            # Each earlier take ended without a result or a hand-back: its worker died.
            error = f"gave up after {attempt - 1 - handbacks} attempts (its worker died each time)"
            return end(attempt, JobStatus.FAILED, FinishReason.ERROR, error, dead=error)
        if entry.deadline_at is not None and entry.deadline_at <= time.time():
            return end(attempt, JobStatus.EXPIRED, FinishReason.DEADLINE,
                       "deadline passed before the job started")
        try:
            seq = self.admission.sequence(entry, entry_id, attempt)
        except (Rejected, ValidationError) as exc:
            return end(attempt, JobStatus.FAILED, FinishReason.ERROR, _reason(exc),
                       dead=_reason(exc))
        seq.entry_json = data.decode()  # as read: a hand-back queues it again unchanged
        seq.queue = queue  # the level's stream it came from: where it is acknowledged
        if attempt > 1:
            seq.restore(self._streamed_tokens(entry.job_id))
        return seq

    def _streamed_tokens(self, job_id: str) -> list[int]:
        """Tokens an earlier attempt already put in the job's log."""
        ids: list[int] = []
        for _id, fields in self.redis.xrange(self.keys.out(job_id), "0-1", "0-18446744073709551615"):
            ids.extend(loads(fields[b"e"])["token_ids"])
        return ids


class _EndingFor:
    def __init__(self, queue: str, entry: QueueEntry, entry_id: str) -> None:
        self.queue, self.entry, self.entry_id = queue, entry, entry_id

    def __call__(
        self,
        attempt: int | None,
        status: JobStatus,
        reason: FinishReason | None = None,
        error: str | None = None,
        dead: str | None = None,
    ) -> Ending:
        return Ending(job_id=self.entry.job_id, queue=self.queue,
                      entry_id=self.entry_id, attempt=attempt, status=status,
                      finish_reason=reason, error=error, dead_letter=dead)


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "entry"
        return f"invalid request: {where}: {first['msg']} ({exc.error_count()} error(s))"
    if isinstance(exc, KeyError):
        return f"malformed entry: missing field {exc.args[0]!r}"
    return f"{type(exc).__name__}: {exc}"
