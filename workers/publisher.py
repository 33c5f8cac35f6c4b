"""The output side: one Redis round trip per engine step.

Token events of the step go to each job's log and channel in one script call;
the final states of the jobs it finished go in one more script call in the same
pipeline. A worker that serves a queue of several partitions makes those calls
per partition, each on a connection to the node that holds the partition's
slot (a script's keys must share one slot), all sent before any reply is read.
Both scripts fence off a worker that lost a job to a reclaim: it finds out
here and drops the job. ``emit.lua`` does it without a read: the attempt is in
the log entry's id, and a newer attempt's resume moves the log's last id past
every id an older one writes, so Redis refuses the stale write.

What ``emit.lua`` does not read is whether a log still holds what this worker
wrote: it cannot lose tokens but by Redis losing writes, which this side sees
as a refused step or a new connection. So a job's events are sent "checked"
(the record and the log's end read first) until one of them is stored, and
again after each refused step or new connection (``_verified``).

Tokens are coalesced per job: the tokens a job makes within ``coalesce_ms`` of
the oldest one held (at most ``coalesce_tokens``) go to Redis as one event, one
log entry and one publish, so Redis does a few commands per event instead of
per token. A job's first token goes at once (the time to first token does not
grow), and so does everything held for a job that ends (its end must follow
its last token). A consumer waits at most the window from one event of a job
to the next: held tokens go out at the last step before the window would pass.

The scripts run by EVALSHA alone (``ScriptCall.command``): redis-py's
pipelined ``Script`` asks ``SCRIPT EXISTS`` before every pipeline, a second
round trip per step. A script the server lost (a restart, ``SCRIPT FLUSH``)
answers NOSCRIPT instead: it is loaded (``scripts.load``) and the whole step
runs again.

No error is taken for success. A step that Redis refused in any way (a lost
connection, OOM, READONLY after a failover, MISCONF, NOSCRIPT) stays pending
here and ``collect`` raises; the caller calls ``collect`` again until the step
is stored. Running a step again is safe: both scripts are idempotent (an event
is logged at an id that its last token gives, so a logged event is neither
logged nor published again; an ended job stays ended), and both refuse to
leave a hole in a log (see the scripts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.exceptions import (
    AskError,
    RedisError,
    ClusterDownError,
    ConnectionError,
    MasterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TimeoutError,
    TryAgainError,
)

from tokenfleet.shared.redis.clock import FleetClock
from tokenfleet.shared.wire.keys import GROUP, Keys, model_of
from tokenfleet.shared.redis.cluster import reread_slot_map
from tokenfleet.shared.redis.connect import node_client
from tokenfleet.shared.wire.schemas import FinishReason
from tokenfleet.shared.wire.scripts import ScriptCall, load
from tokenfleet.shared.wire.serialization import dumps, token_event
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.worker_scripts import (
    Emitted,
    Ending,
    Finished,
    LogEvent,
    emit,
    finish,
    requeue,
)
from tokenfleet.workers.logprobs import Logprobs, wire
from tokenfleet.workers.prompt_logprobs import wire as prompt_wire
from tokenfleet.workers.sequence import SeqOutput
from tokenfleet.workers.sequence import Sequence

hiredis: Any
try:
    import hiredis
except ImportError:  # redis-py works without it, more slowly
    hiredis = None

_T = TypeVar("_T")

__all__ = ["Ending", "Held", "Publisher", "Stored", "is_transient"]

# Error replies about the server's state, not the write: the same write
# succeeds once Redis is back to normal (memory freed, a primary again, a save
# that works, scripts loaded, a cluster slot served, by the node the slot map
# read again names: MOVED, ASK).
_TRANSIENT_TYPES = (ConnectionError, TimeoutError, OSError, OutOfMemoryError, ReadOnlyError,
                    NoScriptError, TryAgainError, ClusterDownError, MasterDownError, AskError)
_TRANSIENT_CODES = ("OOM", "READONLY", "MISCONF", "LOADING", "BUSY", "NOSCRIPT", "TRYAGAIN",
                    "CLUSTERDOWN", "MASTERDOWN", "NOREPLICAS", "UNBLOCKED")


def is_transient(exc: BaseException) -> bool:
    """True for a Redis error that passes when Redis recovers (retry the same
    write); False for one the write itself causes (a wrong key type, a bug)."""
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    return isinstance(exc, ResponseError) and str(exc).split(" ", 1)[0] in _TRANSIENT_CODES


@dataclass
class Stored:
    """What Redis answered about a stored step: the jobs it did not take."""

    fenced: set[str] = field(default_factory=set)  # a newer attempt owns them
    # Their log lacks tokens this worker generated (Redis lost them): the
    # worker's state of them is not to be trusted; nothing more was written.
    untrusted: set[str] = field(default_factory=set)


@dataclass
class Held:
    """Tokens of one job made and not yet sent: they go as one event."""

    seq: Sequence
    index: int  # of the first one
    since: float  # the step before the first one (the publisher's clock)
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # what each token adds to the text
    logprobs: list[Logprobs | None] = field(default_factory=list)  # when the job asked

    @property
    def end(self) -> int:
        return self.index + len(self.token_ids)


@dataclass
class _Writes:
    """One partition's writes of a step: its jobs' keys share the partition's slot."""

    partition: str
    events: list[Held]
    emit: ScriptCall[Emitted] | None
    finish: ScriptCall[Finished] | None
    sent: bool = False  # on the partition's connection, replies not read yet
    replies: list[object] | None = None  # once stored

    @property
    def calls(self) -> list[ScriptCall[object]]:
        """In the order they run: a step's ``finish`` must not run before its ``emit``."""
        return [c for c in (self.emit, self.finish) if c is not None]


@dataclass
class _Step:
    """One step's writes, from ``send`` to ``collect``."""

    events: list[Held]
    writes: list[_Writes]  # one per partition the step wrote to
    ended: list[tuple[str, int]] = field(default_factory=list)  # the runs ``finish`` ends
    ends: list[Sequence] = field(default_factory=list)  # the jobs ``finish`` ends

    def handed_back(self) -> set[str]:
        """Jobs of the step handed back by now (preemption): Redis refuses
        their writes, as expected. Asked once Redis answered: a hand-back that
        fenced a write was flagged before it was sent."""
        return {seq.job_id for seq in [*(e.seq for e in self.events), *self.ends]
                if seq.handed_back}


class Publisher:
    """Owned by the worker's output thread: ``send``, ``collect``, ``discard``
    and the token windows are its. Other threads still call ``end`` and
    ``dead_letter`` (the feeders'), and ``hand_back`` (the engine thread's, for
    preempted jobs; ``stop``'s once the output thread has ended): ``end`` and
    ``hand_back`` also take runs out of ``_verified``, a set the output thread
    reads, each call one set operation under the GIL."""

    def __init__(self, redis: Any, keys: Keys, settings: Settings, worker: str,
                 clock: Callable[[], float] = time.monotonic,
                 fleet_clock: FleetClock | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.worker = worker
        self._pending: _Step | None = None  # sent, not yet collected
        # Per partition: the node's client and the connection taken from it.
        self._conns: dict[str, tuple[Any, Any]] = {}
        # Coalescing: the window (seconds) and the most tokens one event holds;
        # a window of 0 or 1 token sends every token at once.
        self.clock = clock
        # The times stored in job records (first token, end, dead letters):
        # Redis's clock, which readers on other hosts judge them by.
        self.fleet_clock = fleet_clock or FleetClock()
        self.window_s = settings.coalesce_ms / 1000
        self.max_tokens = settings.coalesce_tokens if self.window_s > 0 else 1
        self.held: dict[str, Held] = {}  # by job id
        self._last_send: float | None = None
        # Jobs whose log held what this side wrote when their last event was
        # stored, with no refused step or new connection since: their next
        # event goes unchecked (emit.lua).
        self._verified: set[tuple[str, int]] = set()  # (job id, attempt)

    @property
    def in_flight(self) -> bool:
        """A step was sent and not collected yet."""
        return self._pending is not None

    def discard(self) -> None:
        """Forget the step sent last without storing it (the caller gives it up,
        and its jobs: what they hold here goes too, it would follow a hole)."""
        if self._pending is not None:
            for writes in self._pending.writes:
                if writes.sent:
                    self._drop_connection(writes.partition)  # its replies answer no later step
            for event in self._pending.events:
                self.held.pop(event.seq.job_id, None)
                self._verified.discard(_run(event.seq))
        self._pending = None

    def send(self, outputs: list[SeqOutput]) -> None:
        """Start writing one step without waiting for Redis; ``collect`` waits.

        So the engine can run its next forward pass while Redis stores this
        step: ``step(N+1); collect(N); send(N+1)`` keeps the order (a step's
        writes go out only once the one before is stored) and takes the round
        trip off the engine's path. One step at a time.
        """
        if self._pending is not None:
            raise RuntimeError("collect() the step sent before sending the next")
        events = self._due(outputs)
        endings = [self._ending(o) for o in outputs if o.finished]
        events_of = _by_partition(events, lambda e: e.seq.queue)
        endings_of = _by_partition(endings, lambda e: e.queue)
        parts = list(dict.fromkeys([*events_of, *endings_of]))
        conns: dict[str, Any] = {}
        for part in parts:
            try:
                conns[part] = self._connection(part)  # first: a new one unverifies every log
            except (ConnectionError, TimeoutError, OSError):
                self._drop_connection(part)  # collect() writes through the pool instead
        per_part: list[_Writes] = []
        for part in parts:
            evs, ends = events_of.get(part, []), endings_of.get(part, [])
            per_part.append(_Writes(part, evs, self._emit(evs) if evs else None,
                                    self._finish(ends) if ends else None))
        step = self._pending = _Step(
            events, per_part, [(e.job_id, e.attempt or 0) for e in endings],
            ends=[o.seq for o in outputs if o.finished])
        for writes in step.writes:
            conn = conns.get(writes.partition)
            if conn is None:
                continue
            try:
                conn.send_packed_command(_pack(conn, [call.command() for call in writes.calls]))
                writes.sent = True
            except (ConnectionError, TimeoutError, OSError):
                self._drop_connection(writes.partition)

    def _due(self, outputs: list[SeqOutput]) -> list[Held]:
        """Take this step's tokens into their jobs' held events; return the
        events to send now: a job's first token, a job that ended, an event of
        ``max_tokens``, and one that would leave its consumer waiting past the
        window if it stayed until the next step (taken to last as long as the
        last one). The wait counts from the step before the event's first
        token, when the job's event before it went out at the latest: so the
        time between two events of a job stays within the window."""
        now = self.clock()
        before = self._last_send if self._last_send is not None else now
        next_step = now - before
        self._last_send = now
        due: list[Held] = []
        ended: set[str] = set()
        for o in outputs:
            job_id = o.seq.job_id
            if o.finished:
                ended.add(job_id)
            if o.index is None:
                continue
            held = self.held.get(job_id)
            if held is not None and (held.seq is not o.seq or held.end != o.index):
                due.append(self.held.pop(job_id))  # another run of the job: not one event
                held = None
            if held is None:
                held = self.held[job_id] = Held(o.seq, o.index, since=before)
            held.token_ids.append(o.token_id)  # type: ignore[arg-type]
            held.texts.append(o.text)
            held.logprobs.append(o.logprobs)
        horizon = now + next_step - self.window_s + 1e-6  # a microsecond: the window reached
        for job_id, held in list(self.held.items()):
            if (held.index == 0 or job_id in ended or len(held.token_ids) >= self.max_tokens
                    or held.since <= horizon):
                due.append(self.held.pop(job_id))
        return due

    def collect(self) -> Stored:
        """Wait until the step sent last is stored; return the jobs Redis did not take.

        A lost connection or a lost script writes the whole step again (both
        scripts are idempotent: an event's log entry id is where its tokens
        end, an ended job stays ended). Raises the first error Redis answered (a
        ``RedisError``) while the step is not stored; the step stays pending:
        call again until it returns. Nothing is dropped.
        """
        step = self._pending
        if step is None or not step.writes:
            self._pending = None
            return Stored()
        error: Exception | None = None
        for writes in step.writes:  # each partition's replies read, whatever another's were
            if writes.replies is None:
                try:
                    writes.replies = self._store(writes)
                except RedisError as exc:
                    error = error or exc
        if error is not None:
            raise error  # the step stays pending: the next collect() runs the rest again
        self._pending = None
        stored = Stored()
        for writes in step.writes:
            replies = iter(writes.replies or [])
            emitted = writes.emit.decode(next(replies)) if writes.emit else Emitted()
            finished = writes.finish.decode(next(replies)) if writes.finish else Finished()
            stored.fenced |= emitted.fenced | finished.fenced
            stored.untrusted |= emitted.gaps | finished.untrusted
        stored.untrusted -= stored.fenced
        self._verified.update(_run(e.seq) for e in step.events)
        self._verified.difference_update(step.ended)
        # The caller drops these jobs: what they hold here is never to be sent.
        # A job handed back is no longer this worker's: nothing to drop (what it
        # holds here goes; a later attempt's, should this worker run one, stays).
        handed_back = step.handed_back() if stored.fenced else set()
        for job_id in stored.fenced | stored.untrusted:
            held = self.held.get(job_id)
            if held is not None and (job_id not in handed_back or held.seq.handed_back):
                del self.held[job_id]
        dropped = stored.fenced | stored.untrusted
        if dropped:
            # A snapshot: the feeder's thread may take runs out meanwhile (``end``).
            self._verified -= {run for run in list(self._verified) if run[0] in dropped}
        stored.fenced -= handed_back
        return stored

    def _store(self, writes: _Writes) -> list[object]:
        """One partition's writes of the step, stored: their replies (undecoded).
        Raises the first error Redis answered."""
        results: list[object] | None = None
        conn = self._conns.get(writes.partition)
        if writes.sent and conn is not None:
            try:
                results = [self._reply(conn[1]) for _ in writes.calls]
            except (ConnectionError, TimeoutError, OSError):
                self._drop_connection(writes.partition)
        writes.sent = False
        if results is None or any(isinstance(r, NoScriptError) for r in results):
            self._unverify(writes)
            results = self._execute(writes.partition, writes.calls)  # raises while refused
        for result in results:
            if isinstance(result, Exception):
                self._if_moved(result, writes.partition)
                self._unverify(writes)
                raise result
        return results

    def _unverify(self, writes: _Writes) -> None:
        """Redis refused a step, or its reply was lost: it may have lost writes
        (a restart, a failover), so every job's next event is checked, this
        step's too (its emit is rebuilt so)."""
        self._verified.clear()
        if writes.emit is not None:
            writes.emit = self._emit(writes.events)

    def _connection(self, partition: str) -> Any:
        """The publisher's own connection to the node of ``partition``: replies
        are read a step later, so no other command may share it. On a cluster
        the partition's slot holds all its jobs' keys."""
        if partition not in self._conns:
            self._verified.clear()  # what Redis holds is read again, job by job
            node = self._node_client(partition)
            self._conns[partition] = node, node.connection_pool.get_connection()
        return self._conns[partition][1]

    def _node_client(self, partition: str) -> Any:
        """The client of the node of ``partition``: all its jobs' keys share the
        partition's slot, and a cluster client refuses scripts in a pipeline."""
        return node_client(self.redis, self.keys.queue(partition))

    def _if_moved(self, error: Exception, partition: str) -> None:
        """After a MOVED (or ASK) reply: the partition's slot is another node's
        now (a failover, a resharding); the next try goes to the node that the
        slot map, read again, names (this connection would be answered MOVED for good)."""
        if isinstance(error, AskError):
            self._drop_connection(partition)
            reread_slot_map(self.redis)

    def _drop_connection(self, partition: str | None = None) -> None:
        """Close the connection to ``partition``'s node (None: every one)."""
        for part in list(self._conns) if partition is None else [partition]:
            if part in self._conns:
                node, conn = self._conns.pop(part)
                conn.disconnect()
                node.connection_pool.release(conn)

    @staticmethod
    def _reply(conn: Any) -> object:
        try:
            return conn.read_response()
        except ResponseError as exc:  # an error reply: the others still follow
            return exc

    def end(self, endings: Iterable[Ending]) -> None:
        """Store endings decided outside the engine (expired, rejected, cancelled)."""
        for part, ends in _by_partition(endings, lambda e: e.queue).items():
            self._execute(part, [self._finish(ends)])
            self._verified.difference_update((e.job_id, e.attempt or 0) for e in ends)

    def hand_back(self, seqs: Iterable[Sequence], suspects: frozenset[str] = frozenset()) -> int:
        """Put unfinished jobs back on their queue for another worker; returns how many.

        The hand-back of a job in ``suspects`` counts as an attempt: a job that
        breaks the device of every worker that runs it ends failed after
        max_attempts, instead of going round the fleet for ever.
        """
        seqs = list(seqs)
        self._verified.difference_update(_run(seq) for seq in seqs)
        handed = 0
        for part, of_part in _by_partition([s for s in seqs if s.entry_json],
                                           lambda s: s.queue).items():
            calls = [requeue(self.keys, queue=seq.queue, job_id=seq.job_id,
                             entry_id=seq.entry_id, attempt=seq.attempt,
                             entry_json=seq.entry_json, counts_as_attempt=seq.job_id in suspects)
                     for seq in of_part]
            replies = self._execute(part, calls)
            handed += sum(call.decode(reply) for call, reply in zip(calls, replies))
        return handed

    def dead_letter(self, queue: str, entry_id: str, raw: Any, reason: str) -> None:
        """An entry no job can come from: keep it in the DLQ, take it off the queue."""
        stream = self.keys.queue(queue)
        record = {"reason": reason, "queue": queue, "entry_id": entry_id,
                  "worker": self.worker, "at": self.fleet_clock.now(), "entry": _printable(raw)}
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.keys.dlq(queue), {"data": dumps(record)})
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()

    def _ending(self, o: SeqOutput) -> Ending:
        seq = o.seq
        assert seq.finish_reason is not None
        # The tokens up to the one that ended it: the engine may have run the
        # job a step past a stop string before it learnt of it. (An end with no
        # token is the engine's own: it made nothing after it.)
        token_ids = seq.generated if o.index is None else seq.generated[:o.index + 1]
        return Ending(
            job_id=seq.job_id, queue=seq.queue, entry_id=seq.entry_id, attempt=seq.attempt,
            status=seq.final_status, finish_reason=seq.finish_reason, error=seq.error,
            text=seq.text.text, token_ids=token_ids, num_prompt_tokens=len(seq.prompt_ids),
            dead_letter=seq.error if seq.finish_reason == FinishReason.ERROR else None,
            logged=len(token_ids),
        )

    def _emit(self, events: list[Held]) -> ScriptCall[Emitted]:
        return emit(self.keys, result_ttl_s=self.settings.result_ttl_s,
                    now=self.fleet_clock.now(),
                    events=[LogEvent(e.seq.job_id, e.seq.attempt, e.index, len(e.token_ids),
                                     token_event(e.index, e.token_ids, e.texts,
                                                 wire(e.seq, e.token_ids, e.logprobs),
                                                 prompt_wire(e.seq) if e.index == 0 else None,
                                                 len(e.seq.prompt_ids) if e.index == 0 else None),
                                     checked=_run(e.seq) not in self._verified)
                            for e in events])

    def _finish(self, endings: list[Ending]) -> ScriptCall[Finished]:
        return finish(self.keys, result_ttl_s=self.settings.result_ttl_s, worker=self.worker,
                      now=self.fleet_clock.now(), endings=endings)

    def _execute(self, partition: str, calls: Seq[ScriptCall[object]]) -> list[object]:
        """Run script calls in one pipeline; return their replies (undecoded), or
        raise the first error a call answered.

        After a NOSCRIPT every call runs again, in order, not only the ones
        refused: a step's ``finish`` must not run before its ``emit``.
        """
        results = self._pipeline(partition, calls)
        lost = [call.script for call, result in zip(calls, results)
                if isinstance(result, NoScriptError)]
        if lost:
            load(self._node_client(partition), lost)
            results = self._pipeline(partition, calls)
        for result in results:
            if isinstance(result, Exception):
                self._if_moved(result, partition)
                raise result
        return results

    def _pipeline(self, partition: str, calls: Seq[ScriptCall[object]]) -> list[object]:
        pipe = self._node_client(partition).pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*call.command())
        return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]


def _by_partition(items: Iterable[_T], level: Callable[[_T], str]) -> dict[str, list[_T]]:
    """``items`` by the partition (the queue, of one) of their level's name, in order."""
    found: dict[str, list[_T]] = {}
    for item in items:
        found.setdefault(model_of(level(item)), []).append(item)
    return found


def _run(seq: Sequence) -> tuple[str, int]:
    """A job's run here: a new attempt of the job is a new run, checked anew."""
    return seq.job_id, seq.attempt


def _pack(conn: Any, commands: list[tuple[str | bytes | int | float, ...]]) -> Any:
    """RESP for ``commands``: hiredis's packer takes a whole command in one C
    call (redis-py's wrapper checks every argument in Python first)."""
    if hiredis is None:
        return conn.pack_commands(commands)
    return [b"".join([hiredis.pack_command(command) for command in commands])]


def _printable(raw: Any) -> Any:
    """Stream fields as JSON-safe text, whatever bytes a bad producer wrote."""
    if isinstance(raw, dict):
        return {_printable(k): _printable(v) for k, v in raw.items()}
    if isinstance(raw, bytes):
        return raw.decode("utf-8", errors="replace")
    return raw
