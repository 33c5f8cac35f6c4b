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
from dataclasses import dataclass, field
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
        # job id -> (stream, entry id) of each job handed to the engine, while
        # ``holds`` says it runs here. Feeder thread only.
        self._running: dict[str, tuple[str, str]] = {}

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
        """Take over entries a dead consumer left idle; True if any came.

        The idle entries are listed first (XPENDING ... IDLE) and only those
        this worker does not run are claimed. An entry this worker runs goes
        idle only when the heartbeat, which touches it every ``heartbeat_s``,
        could not (Redis away, a stall). Claiming it to ourselves would change
        nothing but its delivery count, again at every pass; starting it again
        would fence our own attempt. So it is left alone: the heartbeat owns
        its liveness, and if this worker really is stuck, another worker's
        reclaim takes the entry (for it, it is a dead consumer's) and fences
        this one, which is the recovery we want.
        """
        idle_ms = int(self.settings.claim_idle_s * 1000)
        found = False
        for name, stream in self.levels:
            mine = self._running_entries(stream)
            pending = self.redis.xpending_range(stream, GROUP, min="-", max="+",
                                                count=credits + len(mine), idle=idle_ms)
            ids = [p["message_id"] for p in pending
                   if p["message_id"].decode() not in mine][:credits]
            if not ids:
                continue
            # With the idle time again: an entry another worker claimed since
            # the listing has a fresh idle time and stays with it.
            entries = self.redis.xclaim(stream, GROUP, self.consumer, idle_ms, ids)
            if entries:
                log.info("reclaimed %d idle entries of %s", len(entries), stream)
                self.take(name, entries)
                found = True
        return found

    def _running_entries(self, stream: str) -> set[str]:
        """Ids of the entries of ``stream`` whose jobs run here now."""
        self._running = {job: at for job, at in self._running.items() if self.holds(job)}
        return {entry_id for s, entry_id in self._running.values() if s == stream}

    def take(self, queue: str, entries: list[Entry]) -> None:
        """Own, check and hand over entries read from the stream of ``queue``.

        Each entry stands alone: one that cannot be started (a malformed entry,
        a hostile record, an error admitting it) is dead-lettered with its
        reason and the rest of the read runs.
        """
        stream = self.keys.queue(queue)
        parsed: list[tuple[str, QueueEntry, bytes]] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            if fields is None:  # deleted while pending (a cancel): nothing left to run
                self.redis.xack(stream, GROUP, entry_id)
                continue
            try:
                data = fields[b"data"]
                entry = QueueEntry.model_validate_json(data)
            except (KeyError, ValueError, ValidationError) as exc:
                self.publisher.dead_letter(queue, entry_id, fields, _reason(exc))
                continue
            if self._running.get(entry.job_id) == (stream, entry_id) and self.holds(entry.job_id):
                continue  # this very entry runs here: taking it again would fence our own attempt
            parsed.append((entry_id, entry, data))
        if not parsed:
            return
        verdicts = self._start(queue, parsed)
        ready: list[Sequence] = []
        endings: list[tuple[Ending, bytes]] = []
        try:
            for (entry_id, entry, data), verdict in zip(parsed, verdicts):
                try:
                    outcome = self._admit(queue, entry_id, entry, data, verdict)
                except (ConnectionError, TimeoutError, OSError):
                    raise  # Redis is away: the entry stays pending, to be taken again
                except Exception as exc:  # this entry's failure is this entry's alone
                    log.exception("could not admit job %s", entry.job_id)
                    outcome = self._reject(queue, entry_id, entry, data, verdict, exc)
                if isinstance(outcome, Sequence):
                    ready.append(outcome)
                elif outcome is not None:
                    endings.append((outcome, data))
            self._end(queue, endings)
        finally:
            # Started and admitted: they run even if a later entry met an error.
            if ready:
                for seq in ready:
                    self._running[seq.job_id] = (stream, seq.entry_id)
                self.sink(ready)

    def _start(self, queue: str, parsed: list[tuple[str, QueueEntry, bytes]]) -> list[Any]:
        """start.lua for the entries of one read: a verdict per entry."""
        stream = self.keys.queue(queue)
        keys = [self.keys.backlog(self.queue), stream]
        args: list[Any] = [self.consumer, repr(time.time()), GROUP]
        for entry_id, entry, _data in parsed:
            keys.append(self.keys.job(entry.job_id))
            # A job that runs here from another entry: that entry is taken only
            # when it is stale (start.lua deletes it), never run a second time.
            args += (entry_id, "1" if self.holds(entry.job_id) else "0")
        try:
            return self.scripts.start(keys=keys, args=args)  # type: ignore[no-any-return]
        except ResponseError as exc:
            # start.lua checks each record before it writes, so this is a case
            # its checks do not know: start each entry alone, so that only the
            # one that fails is dead-lettered.
            if len(parsed) == 1:
                return [[b"bad", f"could not be started: {exc}".encode(), b"0"]]
            log.warning("start failed for a read of %d entries (%s); starting each alone",
                        len(parsed), exc)
            return [self._start(queue, [one])[0] for one in parsed]

    def _admit(self, queue: str, entry_id: str, entry: QueueEntry, data: bytes,
               verdict: list[Any]) -> Sequence | Ending | None:
        kind = verdict[0].decode()
        end = _EndingFor(queue, entry, entry_id)
        if kind == "missing":
            self.publisher.dead_letter(queue, entry_id, {"data": entry.model_dump_json()},
                                       "no job record: it expired or was never written")
            return None
        if kind in ("stale", "held"):
            # stale: a copy of a job whose live entry is another (start.lua
            # deleted it); held: the job runs here from another entry, which
            # the record does not name (this worker's attempt is about to be
            # fenced off): this entry waits, pending, for the next reclaim.
            log.info("entry %s of job %s is %s; not run", entry_id, entry.job_id, kind)
            return None
        if kind == "bad":
            reason = verdict[1].decode(errors="replace")
            if verdict[2] == b"1":  # a hash: whoever waits on the job hears why it failed
                return end(None, JobStatus.FAILED, FinishReason.ERROR, reason, dead=reason)
            self.publisher.dead_letter(queue, entry_id, {"data": data}, reason)
            return None
        if kind != "run":
            return end(None, JobStatus(kind))  # ended while queued: just acknowledge
        attempt, cancel, handbacks = int(verdict[1]), verdict[2] == b"1", int(verdict[3])
        # An earlier attempt's tokens (a hand-back, a reclaim): the job resumes
        # from them, and any way it ends here keeps them.
        logged = self._resume(entry.job_id, attempt) if attempt > 1 else Logged()
        if logged is None:
            return None  # another worker took the job since start.lua: it is theirs
        if cancel:
            return end(attempt, JobStatus.CANCELLED, FinishReason.CANCELLED, logged=logged)
        if attempt - handbacks > self.settings.max_attempts:
            # Each earlier take ended without a result or a hand-back: its worker died.
            error = f"gave up after {attempt - 1 - handbacks} attempts (its worker died each time)"
            return end(attempt, JobStatus.FAILED, FinishReason.ERROR, error, dead=error,
                       logged=logged)
        if entry.deadline_at is not None and entry.deadline_at <= time.time():
            return end(attempt, JobStatus.EXPIRED, FinishReason.DEADLINE,
                       "deadline passed before the job started", logged=logged)
        try:
            seq = self.admission.sequence(entry, entry_id, attempt)
        except (Rejected, ValidationError) as exc:
            return end(attempt, JobStatus.FAILED, FinishReason.ERROR, _reason(exc),
                       dead=_reason(exc), logged=logged)
        seq.entry_json = data.decode()  # as read: a hand-back queues it again unchanged
        seq.queue = queue  # the level's stream it came from: where it is acknowledged
        seq.restore(logged.token_ids)
        return seq

    def _reject(self, queue: str, entry_id: str, entry: QueueEntry, data: bytes,
                verdict: list[Any], exc: Exception) -> Ending | None:
        """An entry whose admission raised: its job fails with the reason, or,
        when this worker does not own the job, the entry goes to the dead letters."""
        reason = f"could not be admitted: {_reason(exc)}"
        if verdict and verdict[0] == b"run":
            return _EndingFor(queue, entry, entry_id)(
                int(verdict[1]), JobStatus.FAILED, FinishReason.ERROR, reason, dead=reason)
        self.publisher.dead_letter(queue, entry_id, {"data": data}, reason)
        return None

    def _end(self, queue: str, endings: list[tuple[Ending, bytes]]) -> None:
        """Store endings decided here, in one call; if that call fails, each
        alone, and one that still fails goes to the dead letters as it is."""
        if not endings:
            return
        try:
            self.publisher.end(e for e, _ in endings)
            return
        except ResponseError as exc:
            if len(endings) == 1:
                ending, data = endings[0]
                self.publisher.dead_letter(queue, ending.entry_id, {"data": data},
                                           f"its final state could not be stored: {exc}")
                return
        for one in endings:
            self._end(queue, [one])

    def _resume(self, job_id: str, attempt: int) -> Logged | None:
        """What earlier attempts logged: the log's contiguous prefix (resume.lua
        deletes anything past a gap, under this attempt). None when the attempt
        is no longer this worker's."""
        reply = self.scripts.resume(keys=[self.keys.job(job_id), self.keys.out(job_id)],
                                    args=[attempt])
        if reply[0] == b"fenced":
            return None
        events = [loads(payload) for payload in reply[1:]]
        return Logged([t for e in events for t in e["token_ids"]],
                      "".join(e["text"] for e in events))


@dataclass
class Logged:
    """Tokens and text an earlier attempt put in a job's token log."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""


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
        logged: Logged | None = None,
    ) -> Ending:
        logged = logged or Logged()
        return Ending(job_id=self.entry.job_id, queue=self.queue,
                      entry_id=self.entry_id, attempt=attempt, status=status,
                      finish_reason=reason, error=error, dead_letter=dead,
                      text=logged.text, token_ids=logged.token_ids)


def _reason(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "entry"
        return f"invalid request: {where}: {first['msg']} ({exc.error_count()} error(s))"
    if isinstance(exc, KeyError):
        return f"malformed entry: missing field {exc.args[0]!r}"
    return f"{type(exc).__name__}: {exc}"
