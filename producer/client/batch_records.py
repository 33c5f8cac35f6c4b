"""Batches: OpenAI's batch objects and their records in Redis.

A batch's record (``<ns>:batch:{<id>}``, a hash) holds each field of OpenAI's
batch object as JSON, its tenant, and what its driver needs to go on after any
crash: how many lines it has, the next line to feed, how many parts of output
it wrote, and the counts of lines done. The batch's other keys (its lease, its
lines running, the bitmap of lines done) share its hash tag. ``<ns>:batches``
indexes every batch; ``<ns>:batches:t:<tenant>`` a tenant's, for its listing;
``<ns>:batches:active`` holds those not ended, which every driver looks at
(``tokenfleet.batches.driver``), and ``<ns>:batches:open:<tenant>`` a tenant's
not ended (its limit, and its lines' shared window).
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any, Literal

import orjson
from pydantic import BaseModel

from tokenfleet.shared.wire import batch_scripts
from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.ownership import tenant_or_default

Endpoint = Literal["/v1/completions", "/v1/chat/completions"]
ENDPOINTS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")
Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                 "cancelling", "cancelled"]
ENDED = ("failed", "completed", "expired", "cancelled")
OPEN = ("validating", "in_progress", "finalizing", "cancelling")
# What a cancel stops: a batch not yet finalizing.
CANCELLABLE = ("validating", "in_progress")
# OpenAI's window is 24h; shorter ones (seconds, minutes, hours) serve tests and
# urgent work here.
WINDOW = re.compile(r"([1-9][0-9]{0,6})([smh])")
MAX_WINDOW_S = 7 * 24 * 3600
MAX_METADATA = 16
# A creation writes its record and indexes in well under this; a batch not
# active this long after it was made was never finished being made.
CREATION_S = 60


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(BaseModel):
    """OpenAI's batch object (``GET /v1/batches/{id}``)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Status
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = RequestCounts()
    metadata: dict[str, str] | None = None

    @property
    def is_ended(self) -> bool:
        return self.status in ENDED


# The record's own fields, beside the batch object's (stored as JSON, each).
COUNTS = ("total", "completed", "failed")
# Lines are counted without the blank ones. next_line: the first line not yet
# fed; parts: output parts written; queues: the models the creating API key
# allows (JSON, null for any); ending: the end the batch is finalizing to;
# tokens: the tokens its finished lines generated (for a rate).
INTERNAL = ("tenant", "next_line", "parts", "queues", "ending", "tokens", *COUNTS)
# A field per result file made while finalizing (``made:<file id>``), until the
# batch's end deletes those it does not name.
MADE = "made:"


class BatchRecord(BaseModel):
    """A batch as its record holds it: the object, and the driver's state."""

    batch: Batch
    tenant: str
    next_line: int = 0
    parts: int = 0
    queues: list[str] | None = None
    ending: str | None = None
    tokens: int = 0


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def window_s(window: str) -> int:
    """The seconds a ``completion_window`` gives ("24h", "90m", "30s")."""
    found = WINDOW.fullmatch(window) if isinstance(window, str) else None
    seconds = int(found[1]) * {"s": 1, "m": 60, "h": 3600}[found[2]] if found else 0
    if not found or seconds > MAX_WINDOW_S:
        raise InvalidRequest(f"invalid 'completion_window': {window!r}; send '24h' (or a "
                             "shorter window as '<N>h', '<N>m' or '<N>s', at most 168h)")
    return seconds


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64
                       and len(v) <= 512 for k, v in metadata.items())):
        raise InvalidRequest("invalid 'metadata': at most 16 pairs of strings, keys up to 64 "
                             "characters, values up to 512")
    return dict(metadata)


def dumped(batch: Batch) -> dict[str, bytes]:
    """The batch object's fields as the record stores them (each as JSON)."""
    fields = batch.model_dump(mode="json", exclude={"request_counts"})
    return {name: orjson.dumps(value) for name, value in fields.items()}


async def create_batch(client: Any, keys: Keys, *, input_file_id: str, endpoint: str,
                       completion_window: str, metadata: dict[str, str] | None,
                       tenant: str | None, queues: list[str] | None = None,
                       max_open: int | None = None) -> Batch:
    """Record a new batch (``validating``) for the drivers to take up. The
    caller has checked that the input file is the tenant's. ``max_open``: the
    most batches the tenant may have open (``TOKENFLEET_BATCH_MAX_OPEN``);
    past it, ``InvalidRequest`` names the limit and nothing is recorded."""
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"invalid 'endpoint': {endpoint!r}; this gateway runs batches of "
                             f"{' and '.join(ENDPOINTS)}")
    seconds = window_s(completion_window)
    created = time.time()
    now = int(created)
    owner = tenant_or_default(tenant)
    batch = Batch(id=new_batch_id(), endpoint=endpoint, input_file_id=input_file_id,
                  completion_window=completion_window, status="validating", created_at=now,
                  expires_at=now + seconds, metadata=check_metadata(metadata))
    record: dict[str, Any] = {**dumped(batch), "tenant": owner,
                              "queues": orjson.dumps(queues), "next_line": 0, "parts": 0,
                              **{name: 0 for name in COUNTS}}
    await client.hset(keys.batch(batch.id), mapping=record)
    if max_open is not None and not await _opened(client, keys, batch.id, owner, max_open):
        await client.delete(keys.batch(batch.id))
        raise InvalidRequest(
            f"tenant {owner!r} has {max_open} batches open, the most a tenant may have "
            f"(TOKENFLEET_BATCH_MAX_OPEN {max_open}); nothing was made: create it once one "
            "has ended, or cancel one")
    # Indexed after its record exists: a driver or a lister never meets an id
    # without its record.
    pipe = client.pipeline(transaction=False)
    pipe.zadd(keys.batches, {batch.id: created})  # to the µs: listed newest first
    pipe.zadd(keys.tenant_batches(owner), {batch.id: created})
    if max_open is None:  # counted all the same: its lines share the tenant's window
        pipe.sadd(keys.tenant_open_batches(owner), batch.id)
    await pipe.execute()
    await client.sadd(keys.active_batches, batch.id)
    return batch


async def _opened(client: Any, keys: Keys, batch_id: str, tenant: str, limit: int) -> bool:
    """Count the batch among the tenant's open ones, if there is room. With
    none, the set is first cleared of batches that will never leave it: ended
    ones (a driver stopped between its two writes), and ones never made active
    (a creation stopped half way) once older than a creation takes, then asked
    again."""
    if await batch_scripts.batch_open(keys, batch_id, tenant=tenant,
                                      limit=limit).run_async(client) == 0:
        return True
    members = [m.decode() for m in await client.smembers(keys.tenant_open_batches(tenant))]
    pipe = client.pipeline(transaction=False)
    for member in members:
        pipe.hmget(keys.batch(member), "status", "created_at")
        pipe.sismember(keys.active_batches, member)
    # A record that is not a hash any more (an error in its place) is stale too.
    replies = await pipe.execute(raise_on_error=False)
    stale = []
    for member, fields, active in zip(members, replies[::2], replies[1::2]):
        status, created_at = (None, None) if isinstance(fields, Exception) else fields
        if (status is None or orjson.loads(status) in ENDED
                or (not active and int(created_at or 0) < time.time() - CREATION_S)):
            stale.append(member)
    if not stale:
        return False
    await client.srem(keys.tenant_open_batches(tenant), *stale)
    added: int = await batch_scripts.batch_open(keys, batch_id, tenant=tenant,
                                                 limit=limit).run_async(client)
    return added == 0


def parse_record(fields: dict[bytes, bytes]) -> BatchRecord:
    text = {k.decode(): v for k, v in fields.items() if not k.startswith(MADE.encode())}
    counts = {name: int(text.pop(name, b"0")) for name in COUNTS}
    internal = {name: text.pop(name) for name in INTERNAL if name in text}
    obj = {name: orjson.loads(value) for name, value in text.items()}
    batch = Batch.model_validate({**obj, "request_counts": counts})
    return BatchRecord(
        batch=batch, tenant=internal.get("tenant", b"default").decode(),
        next_line=int(internal.get("next_line", b"0")), parts=int(internal.get("parts", b"0")),
        tokens=int(internal.get("tokens", b"0")),
        queues=orjson.loads(internal.get("queues", b"null")),
        ending=internal["ending"].decode() if "ending" in internal else None)


async def read_record(client: Any, keys: Keys, batch_id: str) -> BatchRecord | None:
    fields = await client.hgetall(keys.batch(batch_id))
    return parse_record(fields) if fields else None


async def get_batch(client: Any, keys: Keys, batch_id: str, tenant: str | None
                    ) -> Batch | None:
    """The batch, or None when there is none or it is another tenant's."""
    record = await read_record(client, keys, batch_id)
    if record is None or record.tenant != tenant_or_default(tenant):
        return None
    return record.batch


async def list_batches(client: Any, keys: Keys, tenant: str | None, *,
                       after: str | None = None, limit: int = 20) -> tuple[list[Batch], bool]:
    """The tenant's batches, newest first, after the batch ``after``; and
    whether there are more. Read from the tenant's own index: no other
    tenant's record is read."""
    index = keys.tenant_batches(tenant_or_default(tenant))
    start = 0
    if after is not None:
        rank = await client.zrevrank(index, after)
        start = 0 if rank is None else rank + 1
    ids = await client.zrevrange(index, start, start + limit)
    found: list[Batch] = []
    for batch_id in ids[:limit]:
        batch = await get_batch(client, keys, batch_id.decode(), tenant)
        if batch is not None:
            found.append(batch)
    return found, len(ids) > limit


async def cancel_batch(client: Any, keys: Keys, batch_id: str, tenant: str | None
                       ) -> Batch | None:
    """Ask the batch's driver to cancel it (``cancelling``: it cancels the
    lines' jobs, keeps what finished and ends ``cancelled``). None when there
    is no such batch of the tenant's; a batch past cancelling is left as it is."""
    if await get_batch(client, keys, batch_id, tenant) is None:
        return None
    await batch_scripts.batch_move(
        keys, batch_id, allowed=CANCELLABLE, status="cancelling",
        fields={"cancelling_at": str(int(time.time()))}).run_async(client)
    return await get_batch(client, keys, batch_id, tenant)
