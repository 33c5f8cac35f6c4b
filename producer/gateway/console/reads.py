"""What each console page reads: only what the fleet already keeps, and only
the rows the page shows.

Every read starts from a bounded name (an index, a sorted set, a stream read
with ``COUNT``), never from a scan of the keyspace: a page costs the same
with 100 finished jobs in Redis as with 100,000. ``tenant`` is the viewer's
(``access.Viewer.tenant``): None sees every tenant, as an admin key does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from redis.exceptions import ResponseError

from tokenfleet.client.batch_records import BatchRecord, parse_record, read_record
from tokenfleet.client.protocol import EventCursor
from tokenfleet.client.fleet import fleet_report
from tokenfleet.files import records as files
from tokenfleet.files.records import FileObject
from tokenfleet.shared.redis.liveness import live_since
from tokenfleet.shared.wire import fleet_history
from tokenfleet.shared.wire.declared import indexed_declared
from tokenfleet.shared.wire.keys import DEFAULT_TENANT, job_model, partitions_of
from tokenfleet.shared.wire.ownership import tenant_or_default
from tokenfleet.shared.wire.schemas import JobState, QueueEntry, queue_entry
from tokenfleet.shared.wire.topology import QueueTopology

ROWS = 50  # the most rows a list shows


async def queues(aio: Any, now: float) -> tuple[list[str], dict[str, int], list[Any]]:
    """The queues and partitions to show (the declared ones, and those the last
    15 minutes' workers served), the declared floors, and the 15 minutes' samples."""
    r, keys = aio.redis, aio.keys
    samples = await fleet_history.read(r, keys, now)
    declared = {d.queue: d.min_workers for d in await indexed_declared(r, keys)}
    names = sorted({*declared, *(s.queue.partition("#")[0] for s in samples)})
    pipe = r.pipeline(transaction=False)
    for q in names:
        pipe.get(keys.partitions(q))
    counts = [max(1, int(c or 1)) for c in await pipe.execute()]
    parts = [p for q, n in zip(names, counts) for p in dict.fromkeys([q, *partitions_of(q, n)])]
    return parts, declared, samples


async def fleet(aio: Any, sync: Any, now: float) -> dict[str, Any]:
    """The fleet as ``tokenfleet status`` reports it, of the queues ``queues``
    finds and their workers (live, or seen within the hour), and the 15
    minutes' lines."""
    r, keys = aio.redis, aio.keys
    parts, declared, samples = await queues(aio, now)
    pipe = r.pipeline(transaction=False)
    for p in parts:
        pipe.zrangebyscore(keys.queue_workers(p), live_since(now) - 3600, "+inf")
    names = {n.decode() for found in await pipe.execute() for n in found}
    names |= {s.worker for s in samples}
    report = await asyncio.to_thread(fleet_report, sync, parts, declared,
                                     sorted(keys.worker(n) for n in names))
    report["history"] = fleet_history.series(samples, now)
    return report


async def text_so_far(aio: Any, job_id: str) -> tuple[str, int]:
    """The text a job's token log holds now (a running job's record has none
    yet), and how many tokens it is: the page's live stream goes on from there."""
    cursor = EventCursor()
    cursor.feed_log(await aio.redis.xrange(aio.keys.out(job_id), "-", "+"))
    return "".join(e.text for e in cursor.take()), cursor.next_index


async def job(aio: Any, job_id: str, tenant: str | None) -> JobState | None:
    """One job's record, or None: no such job, or another tenant's."""
    fields = await aio.redis.hgetall(aio.keys.job(job_id)) if job_model(job_id) else {}
    if not fields:
        return None
    state = JobState.from_redis({k.decode(): v.decode() for k, v in fields.items()})
    if tenant is not None and tenant_or_default(state.tenant) != tenant:
        return None
    return state


async def jobs(aio: Any, queues: list[str], tenant: str | None, *, state: str | None,
               of_tenant: str | None) -> list[JobState]:
    """The jobs queued or running on ``queues`` (their streams' entries, newest
    first, at most ``ROWS`` per stream), of the viewer's tenant (or of
    ``of_tenant`` for one who sees all), in ``state`` where given. A finished
    job has left its stream: it is found by its id (``job``)."""
    r, keys = aio.redis, aio.keys
    wanted = tenant if tenant is not None else of_tenant
    streams = []
    for q in queues:
        named = sorted(t.decode() for t in await r.smembers(keys.tenants(q)))
        tenants = named if wanted is None else [t for t in named if t == wanted]
        topology = QueueTopology(keys, q, 1, tuple(tenants))
        streams += [topology.stream(part, p, t) for part, p, t in topology.levels()
                    if wanted is None or tenant_or_default(t) == wanted]
    pipe = r.pipeline(transaction=False)
    for s in streams:
        pipe.xrevrange(s, count=ROWS)
    ids: list[str] = []
    for entries in await pipe.execute(raise_on_error=False):
        if isinstance(entries, ResponseError):
            continue
        # A hostile entry is passed over: the dead letters show it once a worker reads it.
        ids.extend(entry.job_id for _entry_id, fields in entries
                   if (entry := queue_entry(fields)) is not None)
    found = [j for j in await asyncio.gather(*(job(aio, i, tenant) for i in ids[:ROWS * 2]))
             if j is not None]
    if state:
        found = [j for j in found if j.status.value == state]
    found.sort(key=lambda j: j.created_at or 0.0, reverse=True)
    return found[:ROWS]


async def batches(aio: Any, tenant: str | None) -> list[BatchRecord]:
    """The newest ``ROWS`` batches the viewer may see (one round trip for
    their records)."""
    r, keys = aio.redis, aio.keys
    index = keys.batches if tenant is None else keys.tenant_batches(tenant)
    ids = [i.decode() for i in await r.zrevrange(index, 0, ROWS - 1)]
    pipe = r.pipeline(transaction=False)
    for batch_id in ids:
        pipe.hgetall(keys.batch(batch_id))
    records = [parse_record(fields) for fields in await pipe.execute() if fields]
    return [rec for rec in records if tenant is None or rec.tenant == tenant]


async def batch(aio: Any, batch_id: str, tenant: str | None) -> BatchRecord | None:
    record = await read_record(aio.redis, aio.keys, batch_id)
    if record is None or (tenant is not None and record.tenant != tenant):
        return None
    return record


async def file(aio: Any, file_id: str, tenant: str | None) -> FileObject | None:
    if tenant is not None:
        found: FileObject | None = await files.get_file(aio.redis, aio.keys, file_id, tenant)
        return found
    fields = await aio.redis.hgetall(aio.keys.file(file_id))
    return FileObject.model_validate_json(fields[b"object"]) if b"object" in fields else None


async def file_list(aio: Any, tenant: str | None) -> list[FileObject]:
    r, keys = aio.redis, aio.keys
    index = keys.files if tenant is None else keys.tenant_files(tenant)
    ids = [i.decode() for i in await r.zrevrange(index, 0, ROWS - 1)]
    found = await asyncio.gather(*(file(aio, i, tenant) for i in ids))
    return [f for f in found if f is not None]


async def dead_letters(aio: Any, queues: list[str], tenant: str | None) -> list[dict[str, Any]]:
    """The newest dead letters of ``queues``: each with its reason, the job it
    came from where it names one, and whether it can run again (its entry is a
    request the fleet can read). A tenant sees the letters of its own jobs."""
    r, keys = aio.redis, aio.keys
    pipe = r.pipeline(transaction=False)
    for q in queues:
        pipe.xrevrange(keys.dlq(q), count=ROWS)
    letters = []
    for q, entries in zip(queues, await pipe.execute(raise_on_error=False)):
        if isinstance(entries, ResponseError):
            continue
        for entry_id, fields in entries:
            letter = letter_of(q, entry_id.decode(), fields)
            if tenant is None or letter["tenant"] == tenant:
                letters.append(letter)
    letters.sort(key=lambda d: d["at"] or 0.0, reverse=True)
    return letters[:ROWS]


def letter_of(queue: str, entry_id: str, fields: dict[bytes, bytes]) -> dict[str, Any]:
    """One dead letter as the page shows it (``entry``: the request's entry, for a retry)."""
    try:
        record = orjson.loads(fields.get(b"data", b"{}"))
    except orjson.JSONDecodeError:
        record = {}
    if not isinstance(record, dict):
        record = {}
    entry = None
    raw = record.get("entry")
    if isinstance(raw, dict) and isinstance(raw.get("data"), str):
        try:
            entry = QueueEntry.model_validate_json(raw["data"])
        except ValueError:
            entry = None
    return {"id": entry_id, "queue": queue, "reason": str(record.get("reason", "")),
            "at": record.get("at"), "worker": record.get("worker"),
            "job_id": entry.job_id if entry else record.get("job_id"),
            "tenant": tenant_or_default(entry.request.tenant if entry else None),
            "retryable": entry is not None,
            "entry": entry.model_dump_json() if entry is not None else None}


async def webhook_dead(aio: Any, tenant: str | None) -> list[dict[str, Any]]:
    """The webhook events given up: the viewer's tenant's dead list, or every
    tenant's that has a lane (one who sees all)."""
    r, keys = aio.redis, aio.keys
    if tenant is None:
        tenants = sorted(t.decode() for t in await r.smembers(keys.webhook_lanes))
        streams = [keys.webhook_dead, *(keys.webhook_dead_of(t) for t in tenants
                                        if t != DEFAULT_TENANT)]
    else:
        streams = [keys.webhook_dead if tenant == DEFAULT_TENANT else keys.webhook_dead_of(tenant)]
    pipe = r.pipeline(transaction=False)
    for s in streams:
        pipe.xrevrange(s, count=ROWS)
    dead = []
    for stream, entries in zip(streams, await pipe.execute(raise_on_error=False)):
        if isinstance(entries, ResponseError):
            continue
        for entry_id, fields in entries:
            one = {k.decode(): v.decode() for k, v in fields.items()}
            one.pop("data", None)  # the event's body: the receiver's, not the page's
            dead.append({**one, "entry": entry_id.decode(), "stream": stream})
    return dead[:ROWS]


async def tenant_refusals(aio: Any) -> dict[str, dict[str, int]]:
    """Refusals per tenant and reason (the gateways' counts)."""
    raw = await aio.redis.hgetall(aio.keys.tenant_refusals)
    out: dict[str, dict[str, int]] = {}
    for name, count in raw.items():
        tenant, _, reason = name.decode().partition(":")
        out.setdefault(tenant, {})[reason] = int(count)
    return out


async def tenant_tokens(aio: Any, now: float) -> dict[str, int]:
    """Each tenant's tokens served over the last hour (the workers' samples)."""
    samples = await fleet_history.read(aio.redis, aio.keys, now, fleet_history.HISTORY_S)
    return fleet_history.tenant_tokens(samples)

