"""Typed bindings of the scripts a worker runs: ``start.lua`` and ``resume.lua``
(taking jobs), ``emit.lua`` and ``finish.lua`` (a step's writes) and
``requeue.lua`` (a hand-back).

Each function takes the script's keys and arguments as typed values and gives a
:class:`~tokenfleet.shared.wire.scripts.ScriptCall` whose reply is decoded into the
dataclasses below; no caller indexes a reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tokenfleet.shared.wire.keys import GROUP, Keys, model_of, shared_level
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus
from tokenfleet.shared.wire.scripts import Arg, ScriptCall, integer, items, script, text
from tokenfleet.shared.wire.serialization import dumps, end_event

# -- start.lua: one verdict per entry of a read ------------------------------------


class Take(NamedTuple):
    """An entry to start: its job, its stream entry, and whether the caller runs
    the job already (from another entry)."""

    job_id: str
    entry_id: str
    held: bool


@dataclass(frozen=True)
class Run:
    """A new attempt, taken by the caller."""

    attempt: int
    cancel: bool  # cancelled while queued and read: it ends at once
    handbacks: int  # hand-backs so far (they do not count as attempts)


@dataclass(frozen=True)
class Ended:
    """Not to run: it ended (or was cancelled) while queued."""

    status: JobStatus


@dataclass(frozen=True)
class Missing:
    """No job record."""


@dataclass(frozen=True)
class Stale:
    """The record's live entry is another one: this copy was acked and deleted."""


@dataclass(frozen=True)
class RunningHere:
    """The caller runs the job from another entry and the record names this one:
    nothing was written."""


@dataclass(frozen=True)
class Bad:
    """A record that cannot be started, and why; ``writable`` when it is a hash
    (a final state can be stored in it)."""

    reason: str
    writable: bool


StartVerdict = Run | Ended | Missing | Stale | RunningHere | Bad


def _start_verdict(reply: object) -> StartVerdict:
    head, *rest = items(reply)
    kind = text(head)
    if kind == "run":
        attempt, cancel, handbacks = rest
        return Run(integer(attempt), text(cancel) == "1", integer(handbacks))
    if kind == "missing":
        return Missing()
    if kind == "stale":
        return Stale()
    if kind == "held":
        return RunningHere()
    if kind == "bad":
        reason, writable = rest
        return Bad(_lenient(reason), text(writable) == "1")
    return Ended(JobStatus(kind))


def _start_verdicts(reply: object) -> list[StartVerdict]:
    return [_start_verdict(one) for one in items(reply)]


def _lenient(reply: object) -> str:
    """A reply that quotes what a hostile record holds: any bytes."""
    return reply.decode(errors="replace") if isinstance(reply, bytes) else text(reply)


def start(keys: Keys, *, queue: str, level: str, worker: str, now: float,
          takes: Sequence[Take]) -> ScriptCall[list[StartVerdict]]:
    """Take ownership of the jobs of entries read from the stream of ``level``
    (a level of ``queue``): a verdict per take, in order."""
    args: list[Arg] = [worker, repr(now), GROUP]
    for take in takes:
        args += (take.entry_id, "1" if take.held else "0")
    return ScriptCall(
        script("start"),
        (keys.backlog(queue), keys.queue(level), *(keys.job(t.job_id) for t in takes)),
        tuple(args),
        _start_verdicts,
    )


# -- resume.lua ----------------------------------------------------------------------


@dataclass(frozen=True)
class Resumed:
    """The token events an earlier attempt logged (the log's contiguous prefix,
    in order), or ``owned`` False when the attempt is no longer the caller's."""

    owned: bool
    events: tuple[bytes, ...] = ()


def _resumed(reply: object) -> Resumed:
    head, *events = items(reply)
    if text(head) == "fenced":
        return Resumed(owned=False)
    return Resumed(True, tuple(e if isinstance(e, bytes) else text(e).encode() for e in events))


def resume(keys: Keys, *, job_id: str, attempt: int, result_ttl_s: int) -> ScriptCall[Resumed]:
    """Keep the log's contiguous prefix under ``attempt`` and give its events;
    from now on no earlier attempt can write to the log (the fence)."""
    return ScriptCall(script("resume"), (keys.job(job_id), keys.out(job_id)),
                      (attempt, result_ttl_s), _resumed)


# -- emit.lua: a step's token events --------------------------------------------------

# Attempt a logs the event ending at token j at '0-<(a - 1) * LOG_BAND + j>'
# (log_prefix.lua, where the scheme is written, with the same constants);
# attempts past LOG_BANDS share its last band.
LOG_BAND = 10_000_000_000
LOG_BANDS = 900_000


def banded(attempt: int) -> bool:
    """Whether ``attempt`` has a band of its own: its writes are fenced by their ids."""
    return 1 <= attempt <= LOG_BANDS


def log_entry_id(attempt: int, end: int) -> str:
    """The token log id of attempt ``attempt``'s event that ends at token ``end``."""
    return f"0-{(max(1, min(attempt, LOG_BANDS)) - 1) * LOG_BAND + end}"



class LogEvent(NamedTuple):
    """Tokens [first, first + size) of a job, as one event (``payload``, JSON).

    ``checked``: read the job's record and its log's end before the write.
    Needed while Redis may have lost writes of the job since its last event
    the caller stored (an error or a new connection in between, or none stored
    yet); otherwise the entry ids fence and order the writes by themselves
    (emit.lua)."""

    job_id: str
    attempt: int
    first: int  # index of its first token
    size: int  # tokens it holds
    payload: bytes
    checked: bool = True


@dataclass(frozen=True)
class Emitted:
    """The jobs whose events were not logged: ``fenced``, a newer attempt owns
    them; ``gaps``, their log does not end where the event starts (it lost
    tokens: the caller's state of the job is not to be trusted)."""

    fenced: frozenset[str] = frozenset()
    gaps: frozenset[str] = frozenset()


def emit(keys: Keys, *, result_ttl_s: int, now: float,
         events: Sequence[LogEvent]) -> ScriptCall[Emitted]:
    """Log and publish a step's token events, one call for all of them."""
    # The checked events first: the script reads more of them (emit.lua).
    events = sorted(events, key=lambda e: not (e.checked or not banded(e.attempt)))
    checked = sum(1 for e in events if e.checked or not banded(e.attempt))
    job_ids = [e.job_id for e in events]
    script_keys: list[str] = []
    args: list[Arg] = [result_ttl_s, repr(now), checked]
    for n, e in enumerate(events):
        j = keys.of_job(e.job_id)
        script_keys += (j.job, j.out, j.events)
        entry_id = log_entry_id(e.attempt, e.first + e.size)
        args += ((e.attempt, e.first, entry_id, e.payload) if n < checked
                 else (entry_id, e.payload))

    def decode(reply: object) -> Emitted:
        fenced, gaps = items(reply)
        return Emitted(frozenset(job_ids[integer(i)] for i in items(fenced)),
                       frozenset(job_ids[integer(i)] for i in items(gaps)))

    return ScriptCall(script("emit", keys.sharded), tuple(script_keys), tuple(args), decode)


# -- finish.lua: final states ------------------------------------------------------------


@dataclass
class Ending:
    """A job's final state, as stored in its record."""

    job_id: str
    queue: str  # the level's stream it came from: where it is acknowledged
    entry_id: str
    attempt: int | None  # None: no ownership to check (the job never ran here)
    status: JobStatus
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    dead_letter: str | None = None  # reason, when the job also goes to the DLQ
    # Tokens the job's log must hold for the ending to be stored (all that it
    # generated); None: no check (an ending decided before the job ran here).
    logged: int | None = None


@dataclass(frozen=True)
class Finished:
    """The jobs whose final state was not stored: ``fenced``, a newer attempt
    owns them; ``untrusted``, their log does not hold exactly their tokens.
    The others are stored (or had ended before) and acknowledged."""

    fenced: frozenset[str] = frozenset()
    untrusted: frozenset[str] = frozenset()


_FENCED, _UNTRUSTED = 0, 3  # finish.lua's verdicts; 1 stored, 2 had ended


def finish(keys: Keys, *, result_ttl_s: int, worker: str, now: float,
           endings: Sequence[Ending]) -> ScriptCall[Finished]:
    """Store final states, end their logs, tell subscribers, then acknowledge
    and delete their entries: one call for all of ``endings`` (of one model)."""
    job_ids = [e.job_id for e in endings]
    script_keys: list[str] = [keys.dlq(endings[0].queue), keys.job_webhooks(endings[0].queue)]
    args: list[Arg] = [result_ttl_s, GROUP, worker, repr(now)]
    for e in endings:
        dead: bytes | str = ""
        if e.dead_letter:
            dead = dumps({"reason": e.dead_letter, "job_id": e.job_id, "queue": e.queue,
                          "entry_id": e.entry_id, "worker": worker, "at": now,
                          "error": e.error})
        j = keys.of_job(e.job_id)
        script_keys += (j.job, j.out, j.events, j.ends, keys.queue(e.queue))
        args += ("" if e.attempt is None else e.attempt, e.entry_id,
                 end_event(e.status, e.finish_reason, e.error), dead, e.status.value,
                 e.finish_reason.value if e.finish_reason else "", e.error or "", e.text,
                 dumps(e.token_ids),
                 "" if e.num_prompt_tokens is None else e.num_prompt_tokens,
                 "" if e.logged is None else e.logged)

    def decode(reply: object) -> Finished:
        verdicts = [integer(v) for v in items(reply)]
        return Finished(
            frozenset(j for j, v in zip(job_ids, verdicts) if v == _FENCED),
            frozenset(j for j, v in zip(job_ids, verdicts) if v == _UNTRUSTED))

    return ScriptCall(script("finish", keys.sharded), tuple(script_keys), tuple(args), decode)


# -- requeue.lua ----------------------------------------------------------------------------


def _handed_back(reply: object) -> bool:
    return integer(reply) == 1


def requeue(keys: Keys, *, queue: str, job_id: str, entry_id: str, attempt: int,
            entry_json: str, counts_as_attempt: bool) -> ScriptCall[bool]:
    """Hand a job of the caller's ``attempt`` back to the stream of ``queue`` (a
    level; a worker's own level's job goes to the shared one) as a new entry;
    True when handed back, False when it is no longer the caller's.
    ``counts_as_attempt``: it may have broken the worker's device."""
    return ScriptCall(
        script("requeue"),
        (keys.queue(shared_level(queue)), keys.job(job_id), keys.backlog(model_of(queue)),
         keys.queue(queue)),
        (entry_id, attempt, entry_json, GROUP, "1" if counts_as_attempt else ""),
        _handed_back,
    )


def unplace(keys: Keys, *, level: str, job_id: str, entry_id: str) -> ScriptCall[bool]:
    """Move a job waiting unread in the own stream of ``level`` (a worker's own
    level, the caller's: it leaves) to the shared stream of that level; True
    when moved, False when another took, ended or moved it first."""
    return ScriptCall(
        script("unplace"),
        (keys.queue(level), keys.queue(shared_level(level)), keys.job(job_id)),
        (entry_id, GROUP),
        lambda reply: integer(reply) == 1,
    )


# -- fair.lua: a read shared among tenants ---------------------------------------------


class FairLevel(NamedTuple):
    """One priority level of a fair read: its counters, credits and tenants'
    streams, each with its tenant's name and weight."""

    counters: str
    credits: int
    streams: Sequence[tuple[str, str, float]]  # (stream key, tenant, weight)


StreamEntries = list[tuple[bytes, dict[bytes, bytes] | None]]


def _entry(reply: object) -> tuple[bytes, dict[bytes, bytes] | None]:
    """One stream entry as XREADGROUP answers it in a script: [id, [field, value, ...]]."""
    entry_id, fields = items(reply)
    # As bytes, undecoded: a value that is not UTF-8 is the intake's to dead-letter.
    flat = [x if isinstance(x, bytes) else text(x).encode() for x in items(fields)]
    return text(entry_id).encode(), dict(zip(flat[::2], flat[1::2]))


def fair(levels: Sequence[FairLevel], *, consumer: str,
         burst: float) -> ScriptCall[list[tuple[str, StreamEntries]]]:
    """Read credits at each level, dealt among its tenants by weighted virtual
    tokens served; a level's shortfall goes to the others, in ``levels``' order.
    The reply: (stream key, its entries as XREADGROUP's) per stream that gave some."""
    keys: list[str] = []
    args: list[Arg] = [GROUP, consumer, repr(float(burst)), len(levels)]
    for level in levels:
        keys.append(level.counters)
        args += [level.credits, len(level.streams)]
        for stream, tenant, weight in level.streams:
            keys.append(stream)
            args += [tenant, repr(float(weight))]

    def read(reply: object) -> list[tuple[str, StreamEntries]]:
        out = []
        for one in items(reply):
            index, entries = items(one)
            out.append((keys[integer(index) - 1], [_entry(e) for e in items(entries)]))
        return out

    return ScriptCall(script("fair"), tuple(keys), tuple(args), read)


# -- steal.lua, retire.lua: other workers' own streams (placement by prefix) ---------


@dataclass(frozen=True)
class Stolen:
    """What ``steal.lua`` took: (stream key, its entries) per stream that gave
    some, and the ms until the next entry waiting there is old enough (None: none)."""

    taken: list[tuple[str, StreamEntries]]
    due_ms: int | None


def steal(streams: Sequence[tuple[str, int]], *, consumer: str,
          most: int) -> ScriptCall[Stolen]:
    """Take at most ``most`` entries from ``streams`` (key, least age in ms:
    the entries that waited undelivered that long)."""
    keys = [stream for stream, _age in streams]

    def read(reply: object) -> Stolen:
        *found, due = items(reply)
        taken = []
        for one in found:
            index, entries = items(one)
            taken.append((keys[integer(index) - 1], [_entry(e) for e in items(entries)]))
        return Stolen(taken, int(text(due)) if text(due) else None)

    return ScriptCall(script("steal"), tuple(keys),
                      (GROUP, consumer, most, *(age for _stream, age in streams)), read)


def retire(keys: Keys, *, partition: str, tag: str, live_since: float) -> ScriptCall[bool]:
    """Forget the owner ``tag`` of ``partition`` if it is not live and its own
    streams hold nothing; True when it was forgotten."""
    return ScriptCall(
        script("retire"),
        (keys.owners(partition), keys.owned_levels(partition), keys.held(partition, tag),
         keys.queue_workers(partition)),
        (tag, keys.queue(partition), repr(live_since)),
        lambda reply: integer(reply) == 1,
    )
