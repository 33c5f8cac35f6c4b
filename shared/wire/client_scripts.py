"""Typed bindings of the scripts a producer (or an operator's repair) runs:
``submit.lua``, ``cancel.lua``, ``expire.lua`` and ``forget_queue.lua``.

Each function takes the script's keys and arguments as typed values and gives a
:class:`~tokenfleet.shared.wire.scripts.ScriptCall` whose reply is decoded into the
enum or dataclass below; the sync client runs it with ``run``, the asyncio one
with ``run_async``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import orjson
from tokenfleet.shared.wire.keys import (
    BATCH,
    DEFAULT_TENANT,
    GROUP,
    PRIORITIES,
    Keys,
    named_tenant,
)
from tokenfleet.shared.wire.prefixes import PrefixKey
from tokenfleet.shared.wire.schemas import Limit, QueueLimits
from tokenfleet.shared.wire.scripts import Arg, ScriptCall, integer, items, script, text
from tokenfleet.shared.wire.topology import QueueTopology, level_stream


class SubmitVerdict(enum.Enum):
    """What ``submit.lua`` did with a request."""

    QUEUED = "ok"  # recorded and queued now
    DUPLICATE = "dup"  # its idempotency key made a job before: that job's id
    CONFLICT = "conflict"  # its idempotency key was used for another request
    NO_WORKER = "noworker"  # no live worker serves the queue: nothing written
    FULL = "full"  # the queue holds its limit of jobs: nothing written
    OVER_LIMIT = "over"  # the request is over a limit of the queue: nothing written
    TENANTS = "tenants"  # the call missed a tenant's streams: ask again naming ``tenants``


@dataclass(frozen=True)
class Submitted:
    """``submit.lua``'s verdict: the job that runs (QUEUED, DUPLICATE) or why none."""

    admission: SubmitVerdict
    job_id: str | None = None  # QUEUED, DUPLICATE
    depth: int | None = None  # FULL: how many jobs the queue holds
    # FULL, OVER_LIMIT: the limit broken (its name, e.g. "prompt_tokens"), what
    # the request brought, and the limit as the strictest side set it.
    name: str | None = None
    value: int | None = None
    limit: Limit | None = None
    tenants: tuple[str, ...] = ()  # TENANTS: the queue's named tenants
    # NO_WORKER: the time (Redis's clock) until which a worker last counted as
    # live on the queue; None: not served within a day (an unknown name).
    served_until: float | None = None


@dataclass(frozen=True)
class Placement:
    """What ``submit.lua`` places a job by: its prefix keys (shortest first), its
    length in characters, and the heartbeat score a live owner has at least."""

    prefixes: Sequence[PrefixKey]
    length: int
    live_since: float


@dataclass(frozen=True)
class Asked:
    """What a request brings, as ``submit.lua`` weighs it against the limits
    (``QueueLimits``' names); ``prompt_tokens`` only where the caller counted them."""

    new_tokens: int
    payload_bytes: int
    prompt_tokens: int | None = None


def _submitted(reply: object) -> Submitted:
    verdict, *values = (text(x) for x in items(reply))
    admission = SubmitVerdict(verdict)
    if admission in (SubmitVerdict.QUEUED, SubmitVerdict.DUPLICATE):
        return Submitted(admission, job_id=values[0])
    if admission is SubmitVerdict.FULL:
        depth, limit, by, why = values
        return Submitted(admission, depth=int(depth), name="queue", value=int(depth),
                         limit=Limit(value=int(limit), by=by, why=why))
    if admission is SubmitVerdict.OVER_LIMIT:
        name, value, limit, by, why = values
        return Submitted(admission, name=name, value=int(value),
                         limit=Limit(value=int(limit), by=by, why=why))
    if admission is SubmitVerdict.TENANTS:
        return Submitted(admission, tenants=tuple(values))
    if admission is SubmitVerdict.NO_WORKER:
        return Submitted(admission, served_until=float(values[0]) if values[0] else None)
    return Submitted(admission)


def submit(keys: Keys, *, job_id: str, model: str, priority: str, entry_json: str,
           record: Mapping[str, Arg], weight: int, limits: QueueLimits, asked: Asked,
           idempotency_key: str | None, idempotency_ttl_s: int, fingerprint: str,
           live_since: float | None, served_since: float | None = None,
           tenant: str | None = None,
           tenants: Sequence[str] = (),
           placement: Placement | None = None) -> ScriptCall[Submitted]:
    """Admit one job: ``record`` is its hash's fields, ``entry_json`` its stream
    entry, ``weight`` its tokens in the backlog. With ``live_since`` (the
    heartbeat score a live worker has at least) a queue no live worker serves
    is refused, unless it is declared (``tokenfleet queue create``) or a
    worker was live on it at ``served_since`` or later (the grace period of a
    restart; None: no grace); None queues ahead of the workers. ``fingerprint`` (of the
    request) tells a retry from another request under the same key. The
    request (``asked``) is held to the strictest of ``limits`` (the client's)
    and those the queue's workers published. ``tenants``: the queue's named
    tenants as the caller last heard (TENANTS when one is missing).
    ``placement``: its prefixes, to place it on the own stream of a worker that
    holds one (None: the shared stream)."""
    named = named_tenant(tenant)
    known = sorted({*tenants, *([named] if named else [])})
    streams = QueueTopology(keys, model, 1, tuple(known)).streams()
    batch_level = set(QueueTopology(keys, model, 1, tuple(known)).streams(priorities=[BATCH]))
    live = [s for s in streams if s not in batch_level]
    submitted = orjson.dumps({
        "limits": limits.model_dump(mode="json"),
        "asked": {k: v for k, v in asdict(asked).items() if v is not None},
        "live": len(live), "batch": priority == BATCH,
        "qhead": keys.queue(model),
        **({} if placement is None or not placement.prefixes else {"place": {
            "prefix": [list(p) for p in placement.prefixes], "plen": placement.length,
            "held": keys.held(model, ""), "since": placement.live_since, "group": GROUP,
            "level": f"{priority}:{named or DEFAULT_TENANT}"}})})
    return ScriptCall(
        script("submit"),
        (level_stream(keys, model, priority, tenant), keys.job(job_id),
         keys.idempotency(model, idempotency_key or "-"),
         keys.backlog(model), keys.queue_workers(model), keys.limits(model),
         keys.tenants(model), keys.declared(model), keys.served_until(model),
         keys.owners(model), keys.owned_levels(model), *live,
         *(s for s in streams if s in batch_level)),
        (job_id, entry_json, submitted, idempotency_ttl_s, "1" if idempotency_key else "0",
         weight, fingerprint,
         "" if live_since is None else repr(live_since),
         "" if served_since is None else repr(served_since),
         named or "", len(known), *known,
         *(x for pair in record.items() for x in pair)),
        _submitted,
    )


class CancelVerdict(enum.Enum):
    """What ``cancel.lua`` did."""

    CANCELLED = "cancelled"  # it was queued: it ended now
    REQUESTED = "requested"  # it is running: its worker was told
    ENDED = "ended"  # it had ended: nothing to cancel
    MISSING = "missing"  # no such job


def _cancel_verdict(reply: object) -> CancelVerdict:
    return CancelVerdict(text(reply))


def cancel(keys: Keys, *, job_id: str, model: str, priority: str, now: float,
           result_ttl_s: int, end_event: bytes,
           tenant: str | None = None, owner: str | None = None) -> ScriptCall[CancelVerdict]:
    """Cancel a job of queue ``model`` at level ``priority`` for ``tenant`` (its
    stream's key goes to the script with the others: declared keys only)."""
    return ScriptCall(
        script("cancel", keys.sharded),
        (keys.job(job_id), keys.out(job_id), keys.events(job_id),
         level_stream(keys, model, priority, tenant, owner), keys.backlog(model),
         keys.ends(job_id), keys.job_webhooks(model)),
        (repr(now), result_ttl_s, end_event, keys.cancels, job_id, GROUP),
        _cancel_verdict,
    )


class ExpireVerdict(enum.Enum):
    """What ``expire.lua`` did."""

    EXPIRED = "expired"  # it was queued past its deadline: it ended now
    MISSING = "missing"  # no such job
    UNCHANGED = "unchanged"  # not queued, or not yet due


def _expire_verdict(reply: object) -> ExpireVerdict:
    verdict = text(reply)
    if verdict in ("expired", "missing"):
        return ExpireVerdict(verdict)
    return ExpireVerdict.UNCHANGED


def expire(keys: Keys, *, job_id: str, model: str, priority: str, now: float,
           result_ttl_s: int, end_event: bytes, error: str,
           tenant: str | None = None, owner: str | None = None) -> ScriptCall[ExpireVerdict]:
    """End a job still queued at ``now`` past its deadline, and take it off its
    queue (the stream of its level and ``tenant``; ``owner``'s own stream of it
    where placement put it there)."""
    return ScriptCall(
        script("expire", keys.sharded),
        (keys.job(job_id), keys.out(job_id), keys.events(job_id),
         level_stream(keys, model, priority, tenant, owner), keys.backlog(model),
         keys.ends(job_id), keys.job_webhooks(model)),
        (repr(now), result_ttl_s, end_event, GROUP, error),
        _expire_verdict,
    )


def _forgotten(reply: object) -> bool:
    return integer(reply) == 1


def forget_queue(keys: Keys, *, model: str, live_since: float,
                 tenants: Sequence[str] = ()) -> ScriptCall[bool]:
    """Delete the keys of a queue nobody uses; True when it was forgotten, False
    when it is in use (something queued, a consumer group, a live worker, a
    tenant not in ``tenants``: the queue's named tenants as the caller read them)."""
    named = sorted({t for t in tenants if named_tenant(t) is not None})
    return ScriptCall(
        script("forget_queue"),
        (keys.backlog(model), keys.queue_workers(model), keys.tenants(model),
         *(keys.fair(model, p) for p in PRIORITIES),
         *QueueTopology(keys, model, 1, tuple(named)).streams()),
        (repr(live_since), *named),
        _forgotten,
    )
