"""The intake: owns, checks and hands over the entries the feeder read.

One ``start.lua`` call takes ownership of a whole read (a new attempt per job)
and answers a verdict per entry, so each entry stands alone: one that cannot be
started (a malformed entry, a hostile record, an error while admitting it) is
dead-lettered with its reason, and the rest of the read runs. A job that an
earlier attempt began resumes from its token log.

Feeder thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from tokenfleet.shared.wire.errors import invalid_input
from tokenfleet.shared.wire.keys import GROUP, Keys, job_model, model_of
from tokenfleet.shared.wire.schemas import (
    EXPIRED_ERROR,
    REFUSED_BY_WORKER,
    FinishReason,
    JobStatus,
    QueueEntry,
)
from tokenfleet.shared.wire.serialization import loads
from tokenfleet.shared.settings import Settings

from tokenfleet.shared.wire.worker_scripts import (
    Bad,
    Ended,
    Ending,
    Missing,
    Run,
    RunningHere,
    Stale,
    StartVerdict,
    Take,
    resume,
    start,
)
from tokenfleet.workers.admission import Admission, CorruptLog, Rejected
from tokenfleet.workers.publisher import Publisher
from tokenfleet.workers.sequence import Sequence

# Limits no request is over: to read an entry another process's limits let through.
UNBOUNDED = Settings.model_construct(max_prompt_chars=2**62, max_stop_strings=2**62,
                     max_metadata_bytes=2**62, max_payload_bytes=2**62,
                     max_new_tokens_limit=2**62)

log = logging.getLogger(__name__)

Entry = tuple[bytes, dict[bytes, bytes] | None]


class Intake:
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
        holds: Callable[[str], bool],
        started: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.consumer = consumer
        self.queue = queue
        self.admission = admission
        self.publisher = publisher
        self.sink = sink
        self.holds = holds
        # Told the prefix keys of the jobs it started (placement by prefix).
        self.started = started
        # job id -> (stream, entry id) of each job handed to the engine, kept
        # while ``holds`` says it runs here.
        self._running: dict[str, tuple[str, str]] = {}

    def running_entries(self, stream: str) -> set[str]:
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
        over_limits: dict[str, str] = {}  # entry id: why its request is over this worker's limits
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            if fields is None:  # deleted while pending (a cancel): nothing left to run
                self.redis.xack(stream, GROUP, entry_id)
                continue
            try:
                data = fields[b"data"]
                entry, over = self._parse(data)
            except (KeyError, ValueError, ValidationError) as exc:
                self.publisher.dead_letter(queue, entry_id, fields, _reason(exc))
                continue
            if over is not None:
                over_limits[entry_id] = over
            if job_model(entry.job_id) != model_of(queue):
                # Its keys would not share the queue's hash tag (keys.py): on a
                # cluster no script could touch them together with the queue's.
                self.publisher.dead_letter(
                    queue, entry_id, fields, f"job id {entry.job_id[:80]!r} is not of queue "
                    f"{model_of(queue)!r}: ids are '<queue>:<random part>', as submit makes them")
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
                    outcome = self._admit(queue, entry_id, entry, data, verdict,
                                          over_limits.get(entry_id))
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
        if self.started and ready:
            prefixes = {e.job_id: e.prefixes for _id, e, _d in parsed if e.prefixes}
            self.started([k for seq in ready for k in prefixes.get(seq.job_id, ())])

    def _start(self, queue: str,
               parsed: list[tuple[str, QueueEntry, bytes]]) -> list[StartVerdict]:
        """start.lua for the entries of one read: a verdict per entry."""
        # A job that runs here from another entry: that entry is taken only
        # when it is stale (start.lua deletes it), never run a second time.
        takes = [Take(entry.job_id, entry_id, self.holds(entry.job_id))
                 for entry_id, entry, _data in parsed]
        try:
            return start(self.keys, queue=self.queue, level=queue, worker=self.consumer,
                         now=self.publisher.fleet_clock.now(), takes=takes).run(self.redis)
        except ResponseError as exc:
            # start.lua checks each record before it writes, so this is a case
            # its checks do not know: start each entry alone, so that only the
            # one that fails is dead-lettered.
            if len(parsed) == 1:
                return [Bad(f"could not be started: {exc}", writable=False)]
            log.warning("start failed for a read of %d entries (%s); starting each alone",
                        len(parsed), exc)
            return [self._start(queue, [one])[0] for one in parsed]

    def _parse(self, data: bytes) -> tuple[QueueEntry, str | None]:
        """The entry in ``data``, and why its request is over this worker's
        limits (None when it is not). The client that queued it checked it
        against its own settings, which may allow more than this worker's: such
        a job is readable all the same, and fails with the reason (a
        ``ValidationError`` is only an entry that is not a job at all)."""
        try:
            return QueueEntry.model_validate_json(data, context={"settings": self.settings}), None
        except ValidationError as exc:
            entry = QueueEntry.model_validate_json(data, context={"settings": UNBOUNDED})
            return entry, _reason(exc)

    def _admit(self, queue: str, entry_id: str, entry: QueueEntry, data: bytes,
               verdict: StartVerdict, over_limits: str | None = None
               ) -> Sequence | Ending | None:
        end = _EndingFor(queue, entry, entry_id)
        if isinstance(verdict, Missing):
            self.publisher.dead_letter(queue, entry_id, {"data": entry.model_dump_json()},
                                       "no job record: it expired or was never written")
            return None
        if isinstance(verdict, Stale | RunningHere):
            # Stale: a copy of a job whose live entry is another (start.lua
            # deleted it). RunningHere: the job runs here from another entry, yet the
            # record names this one (a newer owner handed it back, so the run
            # here is about to be fenced off): it waits, pending, and once the
            # run here is dropped the next reclaim starts it as the live entry.
            log.info("entry %s of job %s: %s; not run", entry_id, entry.job_id,
                     type(verdict).__name__)
            return None
        if isinstance(verdict, Bad):
            reason = verdict.reason
            if verdict.writable:  # a hash: whoever waits on the job hears why it failed
                return end(None, JobStatus.FAILED, FinishReason.ERROR, reason, dead=reason)
            self.publisher.dead_letter(queue, entry_id, {"data": data}, reason)
            return None
        if isinstance(verdict, Ended):
            return end(None, verdict.status)  # ended while queued: just acknowledge
        attempt, cancel, handbacks = verdict.attempt, verdict.cancel, verdict.handbacks
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
        if entry.deadline_at is not None and entry.deadline_at <= self.publisher.fleet_clock.now():
            return end(attempt, JobStatus.EXPIRED, FinishReason.DEADLINE,
                       EXPIRED_ERROR, logged=logged)
        if over_limits is not None:  # the caller hears why; nothing for an operator
            return end(attempt, JobStatus.FAILED, FinishReason.ERROR,
                       REFUSED_BY_WORKER + over_limits, logged=logged)
        try:
            seq = self.admission.sequence(entry, entry_id, attempt)
            self.admission.resume(seq, logged.token_ids)
        except (Rejected, ValidationError) as exc:
            # The request's own fault (too long, over this worker's limits): its
            # caller hears why; nothing for an operator in the dead letters.
            return end(attempt, JobStatus.FAILED, FinishReason.ERROR,
                       REFUSED_BY_WORKER + _reason(exc).removeprefix("Rejected: "),
                       logged=logged)
        except CorruptLog as exc:  # damage in Redis: the caller and an operator hear
            return end(attempt, JobStatus.FAILED, FinishReason.ERROR, str(exc), dead=str(exc),
                       logged=logged)
        seq.entry_json = data.decode()  # as read: a hand-back queues it again unchanged
        seq.queue = queue  # the level's stream it came from: where it is acknowledged
        return seq

    def _reject(self, queue: str, entry_id: str, entry: QueueEntry, data: bytes,
                verdict: StartVerdict, exc: Exception) -> Ending | None:
        """An entry whose admission raised: its job fails with the reason, or,
        when this worker does not own the job, the entry goes to the dead letters."""
        reason = f"could not be admitted: {_reason(exc)}"
        if isinstance(verdict, Run):
            return _EndingFor(queue, entry, entry_id)(
                verdict.attempt, JobStatus.FAILED, FinishReason.ERROR, reason, dead=reason)
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
        resumed = resume(self.keys, job_id=job_id, attempt=attempt,
                         result_ttl_s=self.settings.result_ttl_s).run(self.redis)
        if not resumed.owned:
            return None
        events = [loads(payload) for payload in resumed.events]
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
        return f"invalid request: {invalid_input(exc)}"
    if isinstance(exc, KeyError):
        return f"malformed entry: missing field {exc.args[0]!r}"
    if isinstance(exc, Rejected):  # a sentence of its own: no class name for the user
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
