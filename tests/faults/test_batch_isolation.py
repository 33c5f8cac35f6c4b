"""One broken batch cannot stop the others. A tenant deletes the input file of
its running batch, then the gateway restarts (its driver is new): the batch
ends failed (``file_not_found``) with a WARNING naming it, its queued lines are
cancelled and its lease let go, and another tenant's batch, stepped after it,
completes. A cancel of the broken batch ends too; so does a batch whose step
fails again and again for another reason. The drivers are stepped by the
test, on a real redis-server and a real worker on the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import RedisError

from tokenfleet.batches import failures as batch_failures
from tokenfleet.client import batch_records
from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.batches.driver import BatchDriver
from tokenfleet.client.batch_records import Batch, cancel_batch, read_record
from tokenfleet.files.records import delete_file
from tokenfleet.shared.file_store import DirectoryStore
from tokenfleet.shared.wire.keys import level_queue

from gateway_server import pin_live_worker

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

IDLE = "idle"  # a queue a live worker seems to serve but never reads: lines stay queued


def completion(model: str, i: int) -> dict[str, Any]:
    return {"custom_id": f"c-{i}", "url": "/v1/completions",
            "body": {"model": model, "prompt": "Once upon a time", "max_tokens": 3,
                     "temperature": 0}}


@pytest.fixture
def ordered_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch ids in the order they are made: the broken batch, made first, is
    stepped first, before the batch it must not hold back."""
    counter = itertools.count()
    monkeypatch.setattr(batch_records, "new_batch_id",
                        lambda: f"batch_{next(counter):04d}")


@pytest.fixture
def fleet(settings: Any, start_worker: Callable[..., Any], tmp_path: Path
          ) -> tuple[Any, DirectoryStore]:
    """A worker on the tiny model; the settings and the file store of the batches."""
    start_worker()
    files = settings.model_copy(update={"files_url": f"file://{tmp_path}"})
    return files, DirectoryStore(tmp_path)


async def step_until(driver: BatchDriver, done: Callable[[], Awaitable[bool]],
                     timeout: float = 60) -> None:
    """Step as ``BatchDriver.run`` does (a step that raises is tried again)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await done():
        assert loop.time() < deadline, "the batches did not end in time"
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await driver.step()
        await asyncio.sleep(0.05)


def all_ended(client: AsyncFleetClient, *batches: Batch) -> Callable[[], Awaitable[bool]]:
    async def ended() -> bool:
        records = [await read_record(client.redis, client.keys, b.id) for b in batches]
        return all(rec is not None and rec.batch.is_ended for rec in records)
    return ended


async def broken_and_other(settings: Any, r: redis.Redis, store: DirectoryStore,
                           client: AsyncFleetClient, *, delete: bool = True
                           ) -> tuple[Batch, Batch]:
    """acme's batch in progress (its lines queued on IDLE), then (``delete``)
    its input file deleted; other's batch made after it, waiting."""
    pin_live_worker(r, settings.namespace, IDLE)
    broken = await client.submit_batch([completion(IDLE, i) for i in range(6)], tenant="acme")
    first = BatchDriver(client, store, name="before-restart")

    async def feeding() -> bool:
        record = await read_record(client.redis, client.keys, broken.id)
        return record is not None and record.next_line > 0

    await step_until(first, feeding)
    await first.release()
    if delete:
        assert await delete_file(client.redis, client.keys, store, broken.input_file_id,
                                 "acme")
    other = await client.submit_batch([completion(settings.queue, i) for i in range(4)],
                                      tenant="other")
    return broken, other


def test_a_batch_whose_input_is_gone_fails_and_the_others_complete(
    fleet: tuple[Any, DirectoryStore], r: redis.Redis, ordered_ids: None,
    caplog: pytest.LogCaptureFixture
) -> None:
    settings, store = fleet

    async def scenario() -> None:
        async with AsyncFleetClient(settings=settings) as client:
            broken, other = await broken_and_other(settings, r, store, client)
            restarted = BatchDriver(client, store, name="after-restart")

            with caplog.at_level(logging.WARNING, logger="tokenfleet.batches"):
                await step_until(restarted, all_ended(client, broken, other))
            ended_other = await client.batch(other.id, tenant="other")
            assert ended_other.status == "completed"
            assert ended_other.request_counts.completed == 4
            ended_broken = await client.batch(broken.id, tenant="acme")
            assert ended_broken.status == "failed"
            assert ended_broken.errors is not None
            assert ended_broken.errors.data[0].code == "file_not_found"
            assert any(broken.id in rec.getMessage() and rec.levelno == logging.WARNING
                       for rec in caplog.records)
            # Nothing of it is held: its queued lines are cancelled, its lease let go.
            keys = client.keys
            assert r.xlen(keys.queue(level_queue(IDLE, "batch", "acme"))) == 0
            assert not r.exists(keys.batch_lease(broken.id), keys.batch_running(broken.id))

    asyncio.run(scenario())


def test_a_cancel_of_a_batch_whose_input_is_gone_ends(
    fleet: tuple[Any, DirectoryStore], r: redis.Redis, ordered_ids: None
) -> None:
    settings, store = fleet

    async def scenario() -> None:
        async with AsyncFleetClient(settings=settings) as client:
            broken, other = await broken_and_other(settings, r, store, client)
            asked = await cancel_batch(client.redis, client.keys, broken.id, "acme")
            assert asked is not None and asked.status == "cancelling"
            restarted = BatchDriver(client, store, name="after-restart")

            await step_until(restarted, all_ended(client, broken, other))
            assert (await client.batch(other.id, tenant="other")).status == "completed"
            assert not r.exists(client.keys.batch_lease(broken.id))

    asyncio.run(scenario())


def test_a_batch_whose_step_keeps_failing_ends_failed_and_the_others_complete(
    fleet: tuple[Any, DirectoryStore], r: redis.Redis, ordered_ids: None,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(batch_failures, "MAX_FAILED_STEPS", 3)
    settings, store = fleet

    async def scenario() -> None:
        async with AsyncFleetClient(settings=settings) as client:
            broken, other = await broken_and_other(settings, r, store, client, delete=False)
            # A key of the batch's that no longer reads as what it must be: every
            # step of it fails (WRONGTYPE), for a reason the driver cannot name.
            r.delete(client.keys.batch_dups(broken.id))
            r.set(client.keys.batch_dups(broken.id), "not a set")
            restarted = BatchDriver(client, store, name="after-restart", step_s=0.05)

            with caplog.at_level(logging.WARNING, logger="tokenfleet.batches"):
                await step_until(restarted, all_ended(client, broken, other))
            assert (await client.batch(other.id, tenant="other")).status == "completed"
            ended_broken = await client.batch(broken.id, tenant="acme")
            assert ended_broken.status == "failed"
            assert ended_broken.errors is not None
            assert ended_broken.errors.data[0].code == "batch_failed"
            warned = [rec for rec in caplog.records
                      if broken.id in rec.getMessage() and rec.levelno == logging.WARNING]
            assert len(warned) == 3

    asyncio.run(scenario())
