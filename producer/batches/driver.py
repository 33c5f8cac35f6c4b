"""The batch driver: takes each batch not yet ended from ``validating`` to its end.

Every gateway runs one (started in its lifespan); ``tokenfleet batch drive``
runs one without a gateway, and ``tokenfleet batch submit --wait`` runs one
while it waits. Each active batch is worked on by the driver holding its lease
(``batch_lease.lua``, renewed every step): a driver that stops (a killed
gateway) lets its lease lapse and another takes the batch over where the
records say it was. All of a batch's state is in Redis and the file store; a
driver keeps only what it can rebuild (its place in the input file, the
checked requests of the lines running).

One step of a batch:

- ``validating``: the input is read once: its lines counted, duplicate
  custom_ids noted; an input that cannot be read, or has no valid line, fails
  the batch (``errors`` says why); else ``in_progress``.
- ``in_progress``: the lines whose jobs ended are written to a part of the
  output or error file and then marked done; lines are fed, at most
  ``TOKENFLEET_BATCH_WINDOW`` queued or running at once, at priority
  ``batch``; a line its endpoint would refuse goes to the error file with the
  endpoint's message. Once every line is done: ``finalizing``.
- past ``expires_at``: the running lines' jobs are cancelled (one that ends
  first keeps its result); the lines not done go to the error file as
  ``batch_expired``; then ``finalizing`` to ``expired``.
- ``cancelling`` (``POST /v1/batches/{id}/cancel``): the running lines' jobs
  are cancelled; what finished is kept; then ``finalizing`` to ``cancelled``.
- ``finalizing``: the parts are joined into the output and error files
  (purpose ``batch_output``), the parts deleted, the batch ends, and a
  ``batch.<end>`` webhook event is queued.

A tenant's batches share one window: at most ``TOKENFLEET_BATCH_WINDOW`` of
its lines are queued or running at once, all its batches together. A step of
one batch that fails touches no other (``tokenfleet.batches.failures``: tried
again later, or ended ``failed``); only Redis out of reach stops a step of
every batch (tried again at the idle pace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenfleet.batches import ends as batch_ends
from tokenfleet.batches import lines as batch_lines
from tokenfleet.batches import output as batch_output
from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.batches.failures import InputGone, StepFailures, input_gone
from tokenfleet.batches.input import skipped, take, validated
from tokenfleet.batches.lines import LineError, Parsed
from tokenfleet.client.batch_records import BatchError, BatchRecord, read_record
from tokenfleet.files.records import max_line_bytes, store_name
from tokenfleet.openai.chat import Chat
from tokenfleet.openai.completions import Completion
from tokenfleet.shared.wire.batch_scripts import batch_done, batch_lease, batch_move
from tokenfleet.shared.wire.errors import QueueFull, TenantQueueFull, TokenfleetError
from tokenfleet.shared.file_store import FileStore
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.keys import job_model

log = logging.getLogger("tokenfleet.batches")

STEP_S = 0.2
# With no batch active anywhere, the active set is read this often, on a
# connection closed after the read: a gateway at rest holds no Redis connection
# (its pool closes one idle for 5 s, and a read every step would keep one
# open). A batch made through a gateway wakes that gateway's driver at once;
# one made elsewhere is taken up within this time.
IDLE_STEP_S = 2.0
# Long enough for a step that reads a whole input file (validating, joining
# the parts); a driver that stops holds its batches this long at most.
LEASE_MS = 20_000
# Past a batch's window, a running line's job asked to stop is waited for this
# long (its worker stops it at its next step, or it ends first and keeps its
# result); one still running then (its worker gone) is written expired.
EXPIRY_GRACE_S = 10.0
# Lines expired (or found invalid) are written in parts of this many.
PART_LINES = 1000
# Once a line's result is in a part, its job's record is kept this long (not
# the fleet's result TTL) and its token log goes at once: the batch's files
# hold the result. Redis then holds the lines of the last minute, not the
# whole batch (a token log is about three quarters of a done line's bytes).
DONE_TTL_S = 60
# A line longer than this is parsed in a thread: a JSON parse grows with the
# line (a line is at most a request's payload limit and 64 KiB).
PARSE_ON_LOOP_BYTES = 64 << 10
# What stops a step of every batch, not one: Redis out of reach (the pool's
# own errors, RedisBusy and RedisUnavailable, are ConnectionErrors too).
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError)

Made = Completion | Chat


@dataclass
class Feeding:
    """What a driver keeps of a batch it works on: its place in the input, the
    lines read but not yet fed, and the checked request of each line running
    (rebuilt from the input after a takeover)."""

    lines: Iterator[tuple[int, bytes]]
    dups: set[int]
    next_line: int  # the record's next line to feed, as this driver last wrote it
    waiting: list[tuple[int, bytes]] = field(default_factory=list)
    made: dict[int, tuple[str | None, Made]] = field(default_factory=dict)
    cancel_asked: set[str] = field(default_factory=set)


class BatchDriver:
    """Drives every active batch whose lease it holds (or can take)."""

    def __init__(self, client: AsyncFleetClient, store: FileStore, *,
                 name: str | None = None, step_s: float = STEP_S,
                 lease_ms: int = LEASE_MS) -> None:
        self.client, self.store = client, store
        self.keys, self.redis = client.keys, client.redis
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.step_s, self.lease_ms = step_s, lease_ms
        self.window = client.settings.batch_window
        self.max_line = max_line_bytes(client.settings.max_payload_bytes)
        self.idle_step_s = max(step_s, IDLE_STEP_S)
        self._feeding: dict[str, Feeding] = {}
        self._wake = asyncio.Event()
        # Each tenant's lines queued or running, read at its first batch of a
        # step and kept up to date through the step.
        self._used: dict[str, int] = {}
        self._failures = StepFailures(step_s)
        # Counts for the gateway's metrics: lines queued as jobs, and lines
        # whose ended job was written to the output or error file.
        self.lines_fed = self.lines_collected = 0

    def wake(self) -> None:
        """Step now (a batch was just made here), not at the next idle step."""
        self._wake.set()

    async def run(self) -> None:
        """Step every active batch, every ``step_s`` (while there is none, look
        for one every ``idle_step_s``), until cancelled."""
        busy = True
        while True:
            try:
                if busy or self._wake.is_set() or await self._any_active():
                    self._wake.clear()
                    busy = await self.step()
            except (RedisError, OSError, TimeoutError) as exc:
                busy = False  # Redis out of reach: looked at again at the idle pace
                log.info("batch step failed (%s); tried again in %.1f s",
                         type(exc).__name__, self.idle_step_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(),
                                       self.step_s if busy else self.idle_step_s)

    async def _any_active(self) -> bool:
        """Whether any batch is active. Read on a connection of the client's pool
        (its bound holds) that is closed after the read: a gateway at rest keeps
        no connection open for the driver's sake."""
        pool = getattr(self.redis, "connection_pool", None)
        if pool is None:  # a cluster's client: a pool per node
            return bool(await self.redis.scard(self.keys.active_batches))
        connection = await pool.get_connection()
        try:
            await connection.send_command("SCARD", self.keys.active_batches)
            count = await connection.read_response()
        finally:
            await connection.disconnect()
            await pool.release(connection)
        return bool(count)

    async def drive(self, batch_id: str, timeout: float | None = None) -> BatchRecord:
        """Step until ``batch_id`` has ended (another driver may hold it: then
        this one only waits), and return its record."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            await self.step()
            record = await read_record(self.redis, self.keys, batch_id)
            if record is None:
                raise KeyError(batch_id)
            if record.batch.is_ended:
                return record
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} did not end within {timeout} s")
            await asyncio.sleep(self.step_s)

    async def step(self) -> bool:
        """One step of every active batch this driver holds the lease of; False
        when there is no active batch (anyone's)."""
        active = {i.decode() for i in await self.redis.smembers(self.keys.active_batches)}
        for batch_id in list(self._feeding):
            if batch_id not in active:
                del self._feeding[batch_id]
        self._failures.keep_only(active)
        self._used.clear()
        for batch_id in sorted(active):
            if self._failures.resting(batch_id):
                continue  # failed lately: tried again at its time
            leased = await batch_lease(self.keys, batch_id, owner=self.name,
                                       ttl_ms=self.lease_ms).run_async(self.redis)
            if not leased:
                self._feeding.pop(batch_id, None)  # another driver's now
                continue
            try:
                await self.step_batch(batch_id)
            except UNREACHABLE:
                raise
            except Exception as exc:  # this batch's own: the others go on
                self._feeding.pop(batch_id, None)  # rebuilt from the records at the next try
                error = (input_gone(batch_id, exc) if isinstance(exc, InputGone)
                         else self._failures.failed(batch_id, exc))
                if error is not None:
                    await batch_ends.abandon(self.client, self.store, batch_id, error)
            else:
                self._failures.succeeded(batch_id)
        return bool(active)

    async def step_batch(self, batch_id: str) -> None:
        record = await read_record(self.redis, self.keys, batch_id)
        if record is None or record.batch.is_ended:
            self._feeding.pop(batch_id, None)
            await batch_ends.ended(self.client, self.store, batch_id, record)
            return
        status = record.batch.status
        if status == "validating":
            await self._validate(record)
        elif status == "finalizing":
            await batch_ends.finalize(self.client, self.store, record)
        elif status == "cancelling" and record.batch.in_progress_at is None:
            await batch_ends.to_finalizing(self.client, self.store, record, "cancelled",
                                           from_=("cancelling",))
        else:
            feeding = self._feeding.get(batch_id)
            if feeding is None or feeding.next_line != record.next_line:
                # New to this driver, or fed by another while this one's lease
                # had lapsed (a step that took longer than the lease).
                feeding = self._feeding[batch_id] = await self._resume(record)
            expiring = status != "cancelling" and time.time() >= (record.batch.expires_at or 0)
            await self._collect(record, feeding, expiring=expiring)
            if status == "cancelling":
                await self._cancel(record, feeding)
            elif expiring:
                await self._expire(record, feeding)
            else:
                await self._feed(record, feeding)
                await self._maybe_done(batch_id)

    # -- validating ---------------------------------------------------------------

    async def _validate(self, record: BatchRecord) -> None:
        batch = record.batch
        try:
            total, valid, dups, errors = await asyncio.to_thread(
                validated, self.store, store_name(batch.input_file_id), batch.endpoint,
                self.max_line)
        except FileNotFoundError:
            await batch_ends.fail(self.client, self.store, record, [BatchError(
                code="file_not_found", param="input_file_id",
                message=f"the input file {batch.input_file_id} cannot be read: it was deleted")])
            return
        if valid == 0:
            await batch_ends.fail(self.client, self.store, record, errors or [BatchError(
                code="empty_file", param="input_file_id", message="the input file has no lines")])
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch.id), "total", total)
        if dups:
            pipe.sadd(self.keys.batch_dups(batch.id), *dups)
        await pipe.execute()
        await batch_move(self.keys, batch.id, allowed=("validating",), status="in_progress",
                         fields={"in_progress_at": str(int(time.time()))}
                         ).run_async(self.redis)

    # -- in progress --------------------------------------------------------------

    async def _resume(self, record: BatchRecord) -> Feeding:
        """Where the batch is: its input read up to the next line to feed, and
        the checked request of each line running (its answer is built from it)."""
        batch = record.batch
        if await self.redis.sadd(self.keys.tenant_open_batches(record.tenant), batch.id):
            # Made before tenants' batches were counted: its lines were not.
            self._used.pop(record.tenant, None)
        running = await self._running(batch.id)
        dups = {int(i) for i in await self.redis.smembers(self.keys.batch_dups(batch.id))}
        try:
            lines, raws = await asyncio.to_thread(
                skipped, self.store, store_name(batch.input_file_id), record.next_line,
                set(running), self.max_line)
        except FileNotFoundError as exc:
            raise InputGone(batch.input_file_id) from exc
        feeding = Feeding(lines, dups, record.next_line)
        for index, raw in raws.items():
            parsed = await _parsed(raw, batch.endpoint, self.client.settings)
            if isinstance(parsed.body, dict):
                ready = await self._ready(record, parsed, index)
                if isinstance(ready, batch_lines.Ready):
                    feeding.made[index] = (parsed.custom_id, ready.made)
        return feeding

    async def _running(self, batch_id: str) -> dict[int, str]:
        running = await self.redis.hgetall(self.keys.batch_running(batch_id))
        return {int(k): v.decode() for k, v in running.items()}

    async def _ready(self, record: BatchRecord, parsed: Parsed, index: int
                     ) -> batch_lines.Ready | LineError:
        assert isinstance(parsed.body, dict)
        return await batch_lines.ready(
            self.client, parsed.body, endpoint=record.batch.endpoint, batch_id=record.batch.id,
            index=index, tenant=record.tenant, queues=record.queues)

    async def _collect(self, record: BatchRecord, feeding: Feeding, *,
                       expiring: bool = False) -> None:
        """Write the lines whose jobs ended, then mark them done (past the window,
        a job cancelled ended by the expiry: its line is ``batch_expired``)."""
        batch_id = record.batch.id
        running = await self._running(batch_id)
        if not running:
            return
        pipe = self.redis.pipeline(transaction=False)
        for index in running:
            pipe.getbit(self.keys.batch_done(batch_id), index)
        # Lines written and marked done by a driver stopped before it let them
        # go: let go below with the lines that end now.
        written = {i: running.pop(i) for i, bit in zip(list(running), await pipe.execute())
                   if bit}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in running.values():
            pipe.hget(self.keys.job(job_id), "status")
        statuses = await pipe.execute()
        out: list[tuple[int, bytes]] = []
        err: list[tuple[int, bytes]] = []
        tokens: dict[int, int] = {}
        for (index, job_id), status in zip(running.items(), statuses):
            if status is not None and status.decode() in ("queued", "running"):
                continue
            custom_id, made = feeding.made.get(index, (None, None))
            try:
                state = await self.client.status(job_id)
            except TokenfleetError:  # the record is gone (expired): nothing to show
                err.append((index, batch_lines.error_line(custom_id, LineError(
                    "job_lost", f"the job {job_id} of this request is gone"))))
                continue
            if not state.status.is_terminal:
                continue
            if state.status.value == "succeeded" and made is not None:
                body = await batch_lines.answer(self.client, made, job_id, state)
                tokens[index] = len(state.token_ids)
                out.append((index, batch_lines.output_line(custom_id, job_id, body)))
            else:
                why = (batch_lines.expired() if expiring and state.status.value == "cancelled"
                       else batch_lines.job_error(state))
                err.append((index, batch_lines.error_line(custom_id, why)))
        await self._record_done(batch_id, out, err, tokens=tokens)
        self.lines_collected += len(out) + len(err)
        ended = written | {i: running[i] for i, _ in out + err}
        await self._let_go(batch_id, ended)
        if record.tenant in self._used:
            self._used[record.tenant] -= len(ended)
        for index in ended:  # written: its checked request is needed no more
            feeding.made.pop(index, None)

    async def _record_done(self, batch_id: str, out: list[tuple[int, bytes]],
                           err: list[tuple[int, bytes]], *,
                           started: dict[int, str] | None = None,
                           next_line: int | None = None,
                           tokens: dict[int, int] | None = None) -> None:
        """Write a part of the lines done, then mark them done and count those not
        done before (``batch_done.lua``: a line collected twice counts once), then
        note the lines started and the next line to feed. A crash in between
        writes the lines again later: joining the parts keeps one of each. Lines
        that were running stay in the running hash until ``_let_go``."""
        keys = self.keys
        if out or err:
            part = await self.redis.hincrby(keys.batch(batch_id), "parts", 1)
            for kind, lines in (("out", out), ("err", err)):
                if lines:
                    await asyncio.to_thread(batch_output.write_part, self.store, batch_id,
                                            kind, part, lines)
        done = ([(i, "out", (tokens or {}).get(i, 0)) for i, _ in out]
                + [(i, "err", 0) for i, _ in err])
        if done:
            await batch_done(keys, batch_id, done).run_async(self.redis)
        pipe = self.redis.pipeline(transaction=True)
        if started:
            pipe.hset(keys.batch_running(batch_id), mapping=started)
        if next_line is not None:
            pipe.hset(keys.batch(batch_id), "next_line", next_line)
        if len(pipe):
            await pipe.execute()

    async def _let_go(self, batch_id: str, jobs: dict[int, str]) -> None:
        """The done lines' records expire soon, and their token logs and
        idempotency keys go now: a done line is never fed again (the next line
        to feed is past it). Then the lines leave the running hash: the job's keys
        live in its queue's slot, not the batch's, so this cannot be one
        transaction, and a driver stopped in between leaves a line running and
        done, let go again at the next collect."""
        if not jobs:
            return
        pipe = self.redis.pipeline(transaction=False)
        for index, job_id in jobs.items():
            job_keys = self.keys.of_job(job_id)
            pipe.expire(job_keys.job, DONE_TTL_S)
            pipe.delete(job_keys.out)
            model = job_model(job_id)
            if model is not None:
                pipe.delete(self.keys.idempotency(model, batch_lines.job_key(batch_id, index)))
        await pipe.execute()
        await self.redis.hdel(self.keys.batch_running(batch_id), *jobs)

    async def release(self) -> None:
        """Give up the leases this driver holds (a gateway stopping), so that
        another driver takes its batches over at once rather than when they lapse."""
        for batch_id in list(self._feeding):
            lease = self.keys.batch_lease(batch_id)
            if (await self.redis.get(lease) or b"").decode() == self.name:
                await self.redis.delete(lease)
        self._feeding.clear()

    async def _tenant_used(self, tenant: str) -> int:
        """The lines of ``tenant``'s open batches queued or running (read at its
        first batch of a step, then kept by this driver's feeds and collects)."""
        if tenant not in self._used:
            ids = await self.redis.smembers(self.keys.tenant_open_batches(tenant))
            pipe = self.redis.pipeline(transaction=False)
            for batch_id in ids:
                pipe.hlen(self.keys.batch_running(batch_id.decode()))
            self._used[tenant] = sum(await pipe.execute()) if ids else 0
        return self._used[tenant]

    async def _feed(self, record: BatchRecord, feeding: Feeding) -> None:
        """Queue lines until ``batch_window`` of the tenant's (all its batches
        together) are queued or running."""
        batch_id = record.batch.id
        room = self.window - await self._tenant_used(record.tenant)
        if room <= 0:
            return
        if len(feeding.waiting) < room:
            feeding.waiting += await asyncio.to_thread(
                take, feeding.lines, room - len(feeding.waiting))
        started: dict[int, str] = {}
        err: list[tuple[int, bytes]] = []
        fed = 0
        for index, raw in feeding.waiting:
            parsed = await _parsed(raw, record.batch.endpoint, self.client.settings)
            outcome: batch_lines.Ready | LineError
            if isinstance(parsed.body, LineError):
                outcome = parsed.body
            elif index in feeding.dups:
                outcome = LineError("duplicate_custom_id", f"custom_id {parsed.custom_id!r} "
                                    "is used by an earlier line of the batch; each must be unique")
            else:
                outcome = await self._ready(record, parsed, index)
            if isinstance(outcome, batch_lines.Ready):
                try:
                    job_id = await self.client.submit(outcome.job, require_worker=False)
                except (QueueFull, TenantQueueFull):
                    break  # the queue is full: this line and the rest wait for room
                except TokenfleetError as exc:
                    outcome = batch_lines.fleet_error(exc, record.batch.endpoint)
                else:
                    started[index] = job_id
                    feeding.made[index] = (parsed.custom_id, outcome.made)
            if isinstance(outcome, LineError):
                err.append((index, batch_lines.error_line(parsed.custom_id, outcome)))
            fed += 1
        if fed:
            next_line = feeding.waiting[fed - 1][0] + 1
            del feeding.waiting[:fed]
            await self._record_done(batch_id, [], err, started=started,
                                    next_line=next_line)
            feeding.next_line = next_line
            self._used[record.tenant] += len(started)
            self.lines_fed += len(started)

    async def _maybe_done(self, batch_id: str) -> None:
        record = await read_record(self.redis, self.keys, batch_id)
        if record is None or record.batch.status != "in_progress":
            return
        counts = record.batch.request_counts
        if counts.completed + counts.failed >= counts.total:
            await batch_ends.to_finalizing(self.client, self.store, record, "completed",
                                           from_=("in_progress",))

    async def _cancel(self, record: BatchRecord, feeding: Feeding) -> None:
        running = await self._running(record.batch.id)
        for job_id in running.values():
            if job_id not in feeding.cancel_asked:
                with contextlib.suppress(TokenfleetError):
                    await self.client.cancel(job_id, timeout=0)
                feeding.cancel_asked.add(job_id)
        if not running:
            await batch_ends.to_finalizing(self.client, self.store, record, "cancelled",
                                           from_=("cancelling",))

    async def _expire(self, record: BatchRecord, feeding: Feeding) -> None:
        """Past the window: the running lines' jobs are cancelled, and every line
        not done ends ``batch_expired``. A job that ends before its cancel takes
        hold keeps its result: the lines are collected after the cancels, and a
        running job asked to stop is waited for (up to ``EXPIRY_GRACE_S``)."""
        batch_id = record.batch.id
        running = await self._running(batch_id)
        for job_id in running.values():
            if job_id not in feeding.cancel_asked:
                with contextlib.suppress(TokenfleetError):
                    await self.client.cancel(job_id, timeout=0)
                feeding.cancel_asked.add(job_id)
        await self._collect(record, feeding, expiring=True)
        running = await self._running(batch_id)
        if running and time.time() < (record.batch.expires_at or 0) + EXPIRY_GRACE_S:
            return  # their workers stop them at their next step: collected then
        expired = batch_lines.expired()
        err = [(index, batch_lines.error_line(feeding.made.get(index, (None,))[0], expired))
               for index in running]
        await self._record_done(batch_id, [], err)
        await self._let_go(batch_id, running)
        while True:
            if not feeding.waiting:
                feeding.waiting = await asyncio.to_thread(take, feeding.lines, PART_LINES)
            if not feeding.waiting:
                break
            err = await asyncio.to_thread(_expired_lines, feeding.waiting,
                                          record.batch.endpoint)
            next_line = feeding.waiting[-1][0] + 1
            feeding.waiting = []
            await self._record_done(batch_id, [], err, next_line=next_line)
            feeding.next_line = next_line
        await batch_ends.to_finalizing(self.client, self.store, record, "expired",
                                       from_=("in_progress", "cancelling"))

    # -- finalizing and after ---------------------------------------------------


async def _parsed(raw: bytes, endpoint: str, settings: Settings) -> Parsed:
    """``batch_lines.parse``, in a thread for a line long enough to hold the loop."""
    if len(raw) > PARSE_ON_LOOP_BYTES:
        return await asyncio.to_thread(batch_lines.parse, raw, endpoint, settings)
    return batch_lines.parse(raw, endpoint, settings)


def _expired_lines(lines: list[tuple[int, bytes]], endpoint: str) -> list[tuple[int, bytes]]:
    """Each line's ``batch_expired`` error line (blocking: each is parsed for its custom_id)."""
    expired = batch_lines.expired()
    return [(index, batch_lines.error_line(batch_lines.parse(raw, endpoint).custom_id, expired))
            for index, raw in lines]
