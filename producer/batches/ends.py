"""How a batch ends: finalizing (its parts joined into the output and error
files), its end status, its webhook event, and its keys and parts let go.

Each step is safe to run again: a driver that takes a ``finalizing`` batch
over joins its parts again; an ended batch still in the active set has its
event queued again and leaves the set (at least once, never lost). A result
file is noted in the batch's record before it is registered: one that the
ended batch does not name (a driver that lost the end to another, or stopped
before it) is deleted when the batch ends, so no tenant lists an orphan.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson

from tokenfleet.batches import output as batch_output
from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.batches.input import MAX_ERRORS
from tokenfleet.client.batch_records import (
    ENDED,
    MADE,
    OPEN,
    BatchError,
    BatchErrors,
    BatchRecord,
    read_record,
)
from tokenfleet.files.records import delete_file, register, write_file
from tokenfleet.shared.wire.batch_scripts import batch_move
from tokenfleet.shared.wire.errors import TokenfleetError
from tokenfleet.shared.file_store import FileStore
from tokenfleet.shared.webhook_outbox import add_event

# An output file may be larger than an upload: it holds the answers.
MAX_OUTPUT_BYTES = 1 << 40


async def fail(client: AsyncFleetClient, store: FileStore, record: BatchRecord,
               errors: list[BatchError]) -> None:
    """A batch whose input cannot run: ``failed``, with ``errors`` saying why."""
    listed = BatchErrors(data=errors[:MAX_ERRORS]).model_dump_json()
    await batch_move(client.keys, record.batch.id, allowed=("validating",), status="failed",
                     fields={"failed_at": str(int(time.time())), "errors": listed}
                     ).run_async(client.redis)
    await ended(client, store, record.batch.id,
                await read_record(client.redis, client.keys, record.batch.id))


async def abandon(client: AsyncFleetClient, store: FileStore, batch_id: str,
                  error: BatchError) -> None:
    """End a batch that cannot go on (its input gone, a step that fails again
    and again) ``failed`` from any status not ended, with ``error``: its
    running lines' jobs are cancelled first, so that it holds no place in the
    queue once ended; then its keys and parts are let go as at any end."""
    keys = client.keys
    running = await client.redis.hgetall(keys.batch_running(batch_id))
    for job_id in running.values():
        with contextlib.suppress(TokenfleetError):
            await client.cancel(job_id.decode(), timeout=0)
    listed = BatchErrors(data=[error]).model_dump_json()
    await batch_move(keys, batch_id, allowed=OPEN, status="failed",
                     fields={"failed_at": str(int(time.time())), "errors": listed}
                     ).run_async(client.redis)
    try:
        record = await read_record(client.redis, keys, batch_id)
    except ValueError:  # a record that no longer parses: it leaves the active set all the same
        record = None
    await ended(client, store, batch_id, record)


async def to_finalizing(client: AsyncFleetClient, store: FileStore, record: BatchRecord,
                        ending: str, from_: tuple[str, ...]) -> None:
    """Move the batch to ``finalizing`` (if it is in one of ``from_``), to end
    as ``ending``, and finalize it."""
    before = await batch_move(
        client.keys, record.batch.id, allowed=from_, status="finalizing",
        fields={"finalizing_at": str(int(time.time())), "ending": ending}
    ).run_async(client.redis)
    if before in from_:
        refreshed = await read_record(client.redis, client.keys, record.batch.id)
        if refreshed is not None:
            await finalize(client, store, refreshed)


async def finalize(client: AsyncFleetClient, store: FileStore, record: BatchRecord) -> None:
    """Join the parts into the output and error files, then end the batch."""
    batch = record.batch
    counts = batch.request_counts
    ids: dict[str, str | None] = {"out": None, "err": None}
    for kind, count in (("out", counts.completed), ("err", counts.failed)):
        if count:
            name = "output" if kind == "out" else "errors"
            file = await asyncio.to_thread(
                write_file, store,
                batch_output.joined(store, batch.id, kind, record.parts, counts.total),
                filename=f"{batch.id}_{name}.jsonl", purpose="batch_output",
                max_bytes=MAX_OUTPUT_BYTES)
            await client.redis.hset(client.keys.batch(batch.id), MADE + file.id, "true")
            await register(client.redis, client.keys, file, record.tenant)
            ids[kind] = file.id
    ending = record.ending or "completed"
    before = await batch_move(client.keys, batch.id, allowed=("finalizing",), status=ending,
                              fields={"output_file_id": orjson.dumps(ids["out"]).decode(),
                                      "error_file_id": orjson.dumps(ids["err"]).decode(),
                                      f"{ending}_at": str(int(time.time()))}
                              ).run_async(client.redis)
    if before != "finalizing":  # another driver ended it meanwhile: its files stand
        for file_id in filter(None, ids.values()):
            await delete_file(client.redis, client.keys, store, file_id, record.tenant)
    await ended(client, store, batch.id, await read_record(client.redis, client.keys, batch.id))


async def drop_unnamed(client: AsyncFleetClient, store: FileStore, record: BatchRecord
                       ) -> None:
    """Delete the result files made for the ended batch that it does not name."""
    key = client.keys.batch(record.batch.id)
    made = [f.decode()[len(MADE):] for f in await client.redis.hkeys(key)
            if f.startswith(MADE.encode())]
    named = (record.batch.output_file_id, record.batch.error_file_id)
    for file_id in made:
        if file_id not in named:
            await delete_file(client.redis, client.keys, store, file_id, record.tenant)
    if made:
        await client.redis.hdel(key, *(MADE + f for f in made))


async def ended(client: AsyncFleetClient, store: FileStore, batch_id: str,
                record: BatchRecord | None) -> None:
    """An ended batch leaves the active set: its event is queued first, so a
    crash in between queues it again rather than never (at least once)."""
    keys = client.keys
    if record is not None and record.batch.status in ENDED:
        metadata = record.batch.metadata or {}
        await add_event(client.redis, keys, f"batch.{record.batch.status}", {"id": batch_id},
                        url=metadata.get("webhook_url"), tenant=record.tenant)
        await client.redis.delete(keys.batch_running(batch_id), keys.batch_done(batch_id),
                                  keys.batch_dups(batch_id))
        await asyncio.to_thread(batch_output.delete_parts, store, batch_id, record.parts)
        await drop_unnamed(client, store, record)
    await client.redis.srem(keys.active_batches, batch_id)
    if record is not None:  # one the record names no more is cleared at a creation
        await client.redis.srem(keys.tenant_open_batches(record.tenant), batch_id)
    await client.redis.delete(keys.batch_lease(batch_id))
