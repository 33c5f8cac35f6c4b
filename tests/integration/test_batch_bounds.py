"""A tenant's batches stay inside bounds of their own: their lines never fill
the queue for live requests, a tenant's batches share one window of lines,
and a tenant's open batches and files are capped. On a real redis-server and
gateway; the queue is one a live worker seems to serve but never reads, so
every line stays queued."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import orjson
import pytest
import redis

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.client.batch_records import create_batch
from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.wire.keys import Keys, level_queue
from tokenfleet.shared.wire.schemas import ApiKey
from tokenfleet.shared.settings import Settings
from tokenfleet.files.tenant_indexes import index_by_tenant

from gateway_server import gateways, pin_live_worker, port_of
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)

IDLE = "idle"


def lines(n: int) -> bytes:
    return b"".join(orjson.dumps({
        "custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": IDLE, "prompt": "Once upon a time", "max_tokens": 4}}) + b"\n"
        for i in range(n))


@pytest.fixture
def fleet(redis_url: str, r: redis.Redis, tmp_path: Any
          ) -> Iterator[Callable[..., dict[str, Any]]]:
    """``start(**settings)``: a gateway (its batch driver) on a namespace of its
    own, with the queue IDLE, and OpenAI clients of the tenants acme and other."""
    with contextlib.ExitStack() as stack:

        def start(**overrides: Any) -> dict[str, Any]:
            settings = Settings(redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                                block_ms=20, files_url=f"file://{tmp_path}",
                                gateway_webhooks=False, **overrides)
            keys = Keys(settings.namespace)
            pin_live_worker(r, settings.namespace, IDLE)
            made = {}
            for tenant in ("acme", "other"):  # before the gateway: it serves keys from its start
                key, key_id = new_key()
                create_key(r, keys, ApiKey(key_id=key_id, tenant=tenant,
                                           created_at=time.time()), key)
                made[tenant] = key
            http = stack.enter_context(gateways(settings))()
            found: dict[str, Any] = {"settings": settings, "keys": keys, "http": http}
            for tenant, key in made.items():
                found[tenant] = stack.enter_context(openai.OpenAI(
                    base_url=f"http://127.0.0.1:{port_of(http)}/v1", api_key=key,
                    max_retries=0, timeout=60))
                found[f"{tenant}_key"] = key
            return found

        yield start


def queued(r: redis.Redis, keys: Keys, tenant: str, priority: str = "batch") -> int:
    return int(r.xlen(keys.queue(level_queue(IDLE, priority, tenant))))


def open_batches(oa: openai.OpenAI, count: int, n_lines: int) -> list[str]:
    file_id = oa.files.create(file=("in.jsonl", lines(n_lines)), purpose="batch").id
    return [oa.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                              completion_window="24h").id for _ in range(count)]


def queued_batches(found: dict[str, Any], r: redis.Redis, count: int, n_lines: int, *,
                   until: int) -> list[str]:
    """acme's ``count`` batches, once ``until`` of their lines are queued."""
    batch_ids = open_batches(found["acme"], count, n_lines)
    wait_until(lambda: queued(r, found["keys"], "acme") >= until, timeout=60,
               what=f"{until} of acme's batch lines to be queued")
    return batch_ids


def live_request(fleet: dict[str, Any], tenant: str) -> int:
    """The status of a streamed completion of ``tenant``: 200 once it is queued."""
    with fleet["http"].stream(
            "POST", "/v1/completions",
            headers={"Authorization": f"Bearer {fleet[tenant + '_key']}"},
            json={"model": IDLE, "prompt": "Hello", "max_tokens": 4, "stream": True}) as answer:
        return answer.status_code


def test_a_live_request_of_another_tenant_is_admitted_while_40_batches_fill_the_queue(
    fleet: Callable[..., dict[str, Any]], r: redis.Redis
) -> None:
    # The window (256 lines) is larger than the queue (20 jobs): the batch
    # lines take the whole queue, and the live requests must still pass.
    found = fleet(max_queue=20)
    keys = found["keys"]
    batch_ids = queued_batches(found, r, 40, 30, until=20)
    assert all(found["acme"].batches.retrieve(b).status in ("validating", "in_progress")
               for b in batch_ids)
    assert live_request(found, "other") == 200
    assert live_request(found, "acme") == 200  # the batches' own tenant too
    assert queued(r, keys, "acme") == 20  # the lines take room live jobs leave, no more


def test_a_tenants_batches_share_one_window_of_lines(
    fleet: Callable[..., dict[str, Any]], r: redis.Redis
) -> None:
    found = fleet(batch_window=8)
    keys = found["keys"]
    batch_ids = queued_batches(found, r, 5, 6, until=8)
    wait_until(lambda: all(found["acme"].batches.retrieve(b).status == "in_progress"
                           for b in batch_ids), timeout=30, what="every batch to be in progress")
    time.sleep(1.0)  # several driver steps: none may feed past the window
    assert queued(r, keys, "acme") == 8
    running = sum(r.hlen(keys.batch_running(b)) for b in batch_ids)
    assert running == 8


def test_a_tenant_past_its_open_batches_or_files_is_refused_naming_the_limit(
    fleet: Callable[..., dict[str, Any]]
) -> None:
    found = fleet(batch_max_open=3, files_max_per_tenant=2)
    acme, other = found["acme"], found["other"]
    open_batches(acme, 3, 2)
    file_id = acme.files.list().data[0].id
    with pytest.raises(openai.BadRequestError) as too_many:
        acme.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                            completion_window="24h")
    assert "TOKENFLEET_BATCH_MAX_OPEN 3" in too_many.value.message
    assert len(acme.batches.list().data) == 3  # nothing of the refused one is kept
    open_batches(other, 1, 2)  # another tenant's count is its own
    acme.files.create(file=("in.jsonl", lines(2)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as files:
        acme.files.create(file=("in.jsonl", lines(2)), purpose="batch")
    assert "TOKENFLEET_FILES_MAX_PER_TENANT 2" in files.value.message
    acme.batches.cancel(acme.batches.list().data[0].id)
    wait_until(lambda: acme.batches.list().data[0].status == "cancelled", timeout=30,
               what="the cancelled batch to end")
    acme.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                        completion_window="24h")  # an ended batch leaves room


def test_an_upload_with_a_line_over_the_line_limit_is_refused_naming_it(
    fleet: Callable[..., dict[str, Any]]
) -> None:
    found = fleet(max_payload_bytes=10_000)
    long_line = orjson.dumps({"custom_id": "x", "body": {"prompt": "a" * 100_000}})
    with pytest.raises(openai.BadRequestError) as refused:
        found["acme"].files.create(file=("in.jsonl", lines(3) + long_line + b"\n"),
                                   purpose="batch")
    assert "a line is over 75536 bytes" in refused.value.message
    assert found["acme"].files.list().data == []


def test_blank_lines_do_not_count_toward_the_line_limit(
    fleet: Callable[..., dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenfleet.files import records as files

    monkeypatch.setattr(files, "MAX_BATCH_LINES", 4)
    found = fleet()
    spaced = b"\n\n  \r\n".join(lines(4).splitlines()) + b"\n\n\t\n"
    assert found["acme"].files.create(file=("in.jsonl", spaced), purpose="batch").id
    with pytest.raises(openai.BadRequestError) as refused:
        found["acme"].files.create(file=("in.jsonl", lines(5)), purpose="batch")
    assert "over 4 lines" in refused.value.message


def test_listings_read_only_the_tenants_own_records(
    fleet: Callable[..., dict[str, Any]], r: redis.Redis
) -> None:
    found = fleet()
    acme, other, keys = found["acme"], found["other"], found["keys"]
    mine = open_batches(acme, 2, 1)
    open_batches(other, 3, 1)
    # Another tenant's records made unreadable: a listing that read them would fail.
    for file_id in r.zrange(keys.files, 0, -1):
        key = keys.file(file_id.decode())
        if r.hget(key, "tenant") == b"other":
            r.delete(key)
            r.set(key, "not a hash")
    for batch_id in r.zrange(keys.batches, 0, -1):
        key = keys.batch(batch_id.decode())
        if r.hget(key, "tenant") == b"other":
            r.delete(key)
            r.set(key, "not a hash")
    assert {b.id for b in acme.batches.list().data} == set(mine)
    assert len(acme.files.list().data) == 1


def test_records_made_before_the_tenants_indexes_are_listed_once_indexed(
    fleet: Callable[..., dict[str, Any]], r: redis.Redis
) -> None:
    found = fleet()
    acme, keys = found["acme"], found["keys"]
    batch_ids = open_batches(acme, 2, 1)
    file_ids = [f.id for f in acme.files.list().data]
    # As a fleet upgraded from one without them: the records, no tenant's index.
    r.delete(keys.tenant_files("acme"), keys.tenant_batches("acme"), keys.tenant_indexes_done)
    assert acme.files.list().data == [] and acme.batches.list().data == []

    async def index() -> int:
        async with AsyncFleetClient(settings=found["settings"]) as client:
            copied = await index_by_tenant(client.redis, client.keys)
            assert await index_by_tenant(client.redis, client.keys) == 0  # once only
            return copied

    assert asyncio.run(index()) == 3
    assert [f.id for f in acme.files.list().data] == file_ids
    assert {b.id for b in acme.batches.list().data} == set(batch_ids)
    assert found["other"].files.list().data == []


def test_batches_that_never_left_the_open_count_are_cleared_by_a_creation_at_the_limit(
    settings: Settings, r: redis.Redis
) -> None:
    keys = Keys(settings.namespace)
    # An ended batch whose driver stopped before it left the count, and a
    # record that is no hash any more: neither may hold a place.
    r.hset(keys.batch("batch_ended"), mapping={"status": '"completed"', "created_at": "1"})
    r.set(keys.batch("batch_hostile"), "not a hash")
    r.sadd(keys.tenant_open_batches("acme"), "batch_ended", "batch_hostile")

    async def create() -> str:
        async with AsyncFleetClient(settings=settings) as client:
            made = await create_batch(client.redis, client.keys, input_file_id="file-x",
                                      endpoint="/v1/completions", completion_window="24h",
                                      metadata=None, tenant="acme", max_open=2)
            return made.id

    made = asyncio.run(create())
    assert r.smembers(keys.tenant_open_batches("acme")) == {made.encode()}
