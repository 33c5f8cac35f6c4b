"""Batches: OpenAI's ``/v1/batches`` and ``client.submit_batch`` on a real
redis-server, a real worker on the tiny model and a gateway (whose batch
driver runs them)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tokenfleet import FleetClient
from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.client.batch_records import RequestCounts
from tokenfleet.files.records import store_name
from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.file_store import open_store
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import ApiKey
from tokenfleet.shared.settings import Settings

from gateway_server import gateways, pin_live_worker, port_of
from helpers import redis_client, wait_until

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["Once upon a time", "The function returns", "Hello there", "In the morning"]


IDLE = "idle"  # a queue a live worker seems to serve but never reads: its jobs stay queued


@pytest.fixture(scope="module")
def fleet(redis_url: str, loaded_tiny: tuple[Any, Any],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One namespace for the module: a tiny worker on 'default', a queue nobody
    reads, a gateway (which runs the batch driver), two tenants' keys."""
    from tokenfleet.workers.build import hf_engine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.service import Worker

    files = tmp_path_factory.mktemp("files")
    settings = Settings(queue="default", redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                        block_ms=20, heartbeat_s=0.5, max_batch=16, max_batch_tokens=65_536,
                        prefetch=4, files_url=f"file://{files}",
                        gateway_webhooks=False)  # the events stay in the outbox, to be read
    r = redis_client(redis_url)
    keys = Keys(settings.namespace)
    pin_live_worker(r, settings.namespace, IDLE)
    model, tokenizer = loaded_tiny
    runner = HFRunner(model, tokenizer)
    worker = Worker(settings, hf_engine(settings, runner, runner.eos_token_ids,
                                        runner.max_model_len), tokenizer, name="w@batches")
    worker.start()
    wait_until(lambda: r.zscore(keys.queue_workers("default"), "w@batches") is not None,
               timeout=30, what="the worker's first heartbeat")

    def make_key(tenant: str) -> str:
        key, key_id = new_key()
        create_key(r, keys, ApiKey(key_id=key_id, tenant=tenant, created_at=time.time()), key)
        return key

    acme, other = make_key("acme"), make_key("other")
    with gateways(settings) as start, FleetClient(settings=settings) as client:
        http = start()
        with openai_client(http, acme) as oa, openai_client(http, other) as oa_other:
            yield {"settings": settings, "r": r, "keys": keys, "client": client,
                   "oa": oa, "other": oa_other}
    worker.stop(grace_s=0)
    r.close()


def openai_client(http: httpx.Client, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(http)}/v1", api_key=key,
                         max_retries=0, timeout=60)


def completion_line(i: int, max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "default", "prompt": PROMPTS[i % len(PROMPTS)],
                     "max_tokens": max_tokens, "temperature": 0}}


def chat_line(i: int, max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": f"m-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "default", "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n"
                    for line in lines)


def upload(fleet: dict[str, Any], data: bytes, oa: openai.OpenAI | None = None) -> str:
    """The input file, uploaded through ``/v1/files`` as the key's tenant."""
    return (oa or fleet["oa"]).files.create(file=("in.jsonl", data), purpose="batch").id


def ended(oa: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    found: list[Any] = []

    def done() -> bool:
        found[:] = [oa.batches.retrieve(batch_id)]
        return found[0].status in ("completed", "failed", "expired", "cancelled")
    wait_until(done, timeout=timeout, what=f"batch {batch_id} to end")
    return found[0]


def content(fleet: dict[str, Any], file_id: str) -> bytes:
    """A file's bytes through ``/v1/files/{id}/content``."""
    return fleet["oa"].files.content(file_id).content


def results(fleet: dict[str, Any], file_id: str | None) -> dict[str, Any]:
    if file_id is None:
        return {}
    lines = [orjson.loads(line) for line in content(fleet, file_id).splitlines()
             if line.strip()]
    return {line["custom_id"]: line for line in lines}


def events(fleet: dict[str, Any], batch_id: str) -> list[str]:
    """The webhook events queued for the batch, by type."""
    entries = fleet["r"].xrange(fleet["keys"].webhook_outbox)
    return [fields[b"type"].decode() for _, fields in entries
            if orjson.loads(fields[b"data"]) == {"id": batch_id}]


@pytest.mark.slow
def test_submit_batch_runs_to_completed_with_one_output_line_per_request(
    fleet: dict[str, Any]
) -> None:
    client: FleetClient = fleet["client"]
    lines = [completion_line(i) for i in range(6)]
    batch = client.submit_batch(iter(lines), completion_window="24h")
    assert batch.status == "validating" and batch.endpoint == "/v1/completions"
    wait_until(lambda: client.batch(batch.id).status == "completed", timeout=60,
               what="the batch to complete")
    done = client.batch(batch.id)
    assert done.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}
    assert done.output_file_id and done.error_file_id is None
    out = list(client.batch_results(batch.id, order="input"))
    assert [line["custom_id"] for line in out] == [f"c-{i}" for i in range(6)]
    singles = {p: client.wait(client.submit(p, max_new_tokens=4, temperature=0.0),
                              timeout=60).text for p in PROMPTS}
    for i, line in enumerate(out):
        body = line["response"]["body"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == singles[PROMPTS[i % len(PROMPTS)]]
        assert client.status(line["response"]["request_id"]).priority == "batch"


@pytest.mark.slow
def test_the_openai_client_runs_200_lines_each_equal_to_the_single_request(
    fleet: dict[str, Any]
) -> None:
    oa: openai.OpenAI = fleet["oa"]
    batches = {}
    for endpoint, make in (("/v1/completions", completion_line),
                           ("/v1/chat/completions", chat_line)):
        file_id = upload(fleet, jsonl([make(i) for i in range(100)]))
        batches[endpoint] = oa.batches.create(input_file_id=file_id, endpoint=endpoint,
                                              completion_window="24h",
                                              metadata={"purpose": "test"})
        assert batches[endpoint].status == "validating"
    singles = {p: oa.completions.create(model="default", prompt=p, max_tokens=4,
                                        temperature=0).choices[0].text for p in PROMPTS}
    chats = {p: oa.chat.completions.create(
        model="default", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": p}]).choices[0].message.content for p in PROMPTS}
    for endpoint, batch in batches.items():
        done = ended(oa, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed,
                done.request_counts.failed) == (100, 100, 0)
        assert done.metadata == {"purpose": "test"}
        assert events(fleet, batch.id) == ["batch.completed"]
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        out = results(fleet, done.output_file_id)
        prefix = "c" if endpoint == "/v1/completions" else "m"
        assert sorted(out) == sorted(f"{prefix}-{i}" for i in range(100))
        for custom_id, line in out.items():
            prompt = PROMPTS[int(custom_id[2:]) % len(PROMPTS)]
            body = line["response"]["body"]
            assert line["id"].startswith("batch_req_") and line["error"] is None
            if prefix == "c":
                assert body["choices"][0]["text"] == singles[prompt]
            else:
                assert body["object"] == "chat.completion"
                assert body["choices"][0]["message"]["content"] == chats[prompt]
    listed = oa.batches.list(limit=1)
    assert [b.id for b in listed.data] == [batches["/v1/chat/completions"].id]
    assert listed.has_more
    after = oa.batches.list(after=listed.data[0].id, limit=100)
    assert batches["/v1/completions"].id in [b.id for b in after.data]


@pytest.mark.slow
def test_bad_lines_go_to_the_error_file_with_the_single_requests_message(
    fleet: dict[str, Any]
) -> None:
    oa: openai.OpenAI = fleet["oa"]
    too_long = {"model": "default", "prompt": "hi", "max_tokens": 10**9}
    with pytest.raises(openai.BadRequestError) as single:
        oa.completions.create(**too_long)
    lines = [completion_line(0), b"{not json", completion_line(1),
             {**completion_line(2), "url": "/v1/chat/completions", "custom_id": "wrong-url"},
             {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
              "body": too_long},
             {**completion_line(3), "custom_id": "c-0"},  # a duplicate custom_id
             {"method": "POST", "url": "/v1/completions", "body": completion_line(0)["body"]}]
    batch = oa.batches.create(input_file_id=upload(fleet, jsonl(lines)),
                              endpoint="/v1/completions", completion_window="24h")
    done = ended(oa, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (7, 2, 5)
    assert sorted(results(fleet, done.output_file_id)) == ["c-0", "c-1"]
    errors = [orjson.loads(line) for line in
              content(fleet, done.error_file_id or "").splitlines()]
    by_id = {e["custom_id"]: e for e in errors}
    # A request the endpoint refused: its status and whole error body, as OpenAI writes it.
    too_long_line = by_id.pop("too-long")
    assert too_long_line["error"] is None
    assert too_long_line["response"]["status_code"] == single.value.status_code == 400
    assert too_long_line["response"]["body"] == single.value.response.json()
    assert too_long_line["response"]["request_id"]
    # Lines that made no request: an error code, no response.
    assert all(e["response"] is None for e in errors if e["custom_id"] != "too-long")
    assert by_id["wrong-url"]["error"]["code"] == "invalid_url"
    assert by_id["c-0"]["error"]["code"] == "duplicate_custom_id"
    assert sorted(e["error"]["code"] for e in errors if e["custom_id"] is None) == [
        "invalid_json", "missing_custom_id"]


def test_a_batch_of_only_bad_lines_or_of_a_deleted_file_fails_saying_why(
    fleet: dict[str, Any]
) -> None:
    oa: openai.OpenAI = fleet["oa"]
    batch = oa.batches.create(input_file_id=upload(fleet, b"{nope\n"),
                              endpoint="/v1/completions", completion_window="24h")
    done = ended(oa, batch.id)
    assert done.status == "failed" and done.failed_at
    assert done.errors is not None and done.errors.data
    assert done.errors.data[0].code == "invalid_json" and done.errors.data[0].line == 1
    assert events(fleet, batch.id) == ["batch.failed"]

    file_id = upload(fleet, jsonl([completion_line(0)]))
    open_store(fleet["settings"].files_url).delete(store_name(file_id))  # its bytes lost
    batch = oa.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                              completion_window="24h")
    done = ended(oa, batch.id)
    assert done.status == "failed" and done.errors is not None
    assert done.errors.data[0].code == "file_not_found"


def test_cancel_keeps_the_finished_lines_and_cancels_the_rest(fleet: dict[str, Any]) -> None:
    oa: openai.OpenAI = fleet["oa"]
    lines = [completion_line(i) for i in range(3)] + [
        {**completion_line(i), "custom_id": f"idle-{i}",
         "body": {**completion_line(i)["body"], "model": IDLE}} for i in range(3)]
    batch = oa.batches.create(input_file_id=upload(fleet, jsonl(lines)),
                              endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: (oa.batches.retrieve(batch.id).request_counts or
                        RequestCounts()).completed == 3, timeout=60,
               what="the served lines to finish")
    cancelling = oa.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = ended(oa, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert sorted(results(fleet, done.output_file_id)) == ["c-0", "c-1", "c-2"]
    errors = results(fleet, done.error_file_id)
    assert sorted(errors) == ["idle-0", "idle-1", "idle-2"]
    assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
    assert events(fleet, batch.id) == ["batch.cancelled"]
    r, keys = fleet["r"], fleet["keys"]
    assert r.xlen(keys.queue(f"{IDLE}:batch:acme")) == 0  # nothing left queued


def test_lines_not_done_when_the_window_ends_expire(fleet: dict[str, Any]) -> None:
    oa: openai.OpenAI = fleet["oa"]
    lines = [completion_line(0)] + [
        {**completion_line(i), "custom_id": f"idle-{i}",
         "body": {**completion_line(i)["body"], "model": IDLE}} for i in range(4)]
    batch = oa.batches.create(input_file_id=upload(fleet, jsonl(lines)),
                              endpoint="/v1/completions",
                              completion_window="6s")  # type: ignore[arg-type]
    assert batch.expires_at is not None and batch.expires_at - batch.created_at == 6
    done = ended(oa, batch.id, timeout=30)
    assert done.status == "expired" and done.expired_at
    assert sorted(results(fleet, done.output_file_id)) == ["c-0"]
    errors = results(fleet, done.error_file_id)
    assert sorted(errors) == [f"idle-{i}" for i in range(4)]
    assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}
    assert events(fleet, batch.id) == ["batch.expired"]


def test_a_line_that_ends_just_before_its_expiry_cancel_keeps_its_result(
    settings: Settings, start_worker: Any, tmp_path: Any
) -> None:
    """The window ends while a line's job is queued; its job ends (succeeded)
    before the driver's cancel reaches it: the line is in the output file, not
    expired."""
    from tokenfleet.batches.driver import BatchDriver

    settings = settings.model_copy(update={"files_url": f"file://{tmp_path}/files"})
    pin_live_worker(redis_client(settings.redis_url), settings.namespace, "default")

    async def main() -> None:
        async with AsyncFleetClient(settings=settings) as client:
            keys = client.keys
            batch = await client.submit_batch([completion_line(0)])
            driver = BatchDriver(client, open_store(settings.files_url), step_s=0.05)
            while not await client.redis.hlen(keys.batch_running(batch.id)):
                await driver.step()  # fed: queued, no worker reads it yet
            cancel = client.cancel

            async def cancel_too_late(job_id: str, timeout: float = 0) -> bool:
                await asyncio.to_thread(start_worker)
                await client.wait(job_id, timeout=60)  # it ended first
                return await cancel(job_id, timeout=timeout)

            client.cancel = cancel_too_late  # type: ignore[method-assign]
            await client.redis.hset(keys.batch(batch.id), "expires_at", int(time.time()) - 1)
            done = await driver.drive(batch.id, timeout=60)
            assert done.batch.status == "expired"
            assert done.batch.request_counts.completed == 1
            lines = [line async for line in client.batch_results(batch.id)]
            assert [line["custom_id"] for line in lines] == ["c-0"]
            assert lines[0]["response"]["status_code"] == 200

    asyncio.run(main())


def test_finalizing_twice_or_again_after_a_crash_leaves_no_orphan_file(
    settings: Settings, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two drivers finalize a batch at once (a lease that lapsed), and one
    stopped after registering its output file but before ending the batch:
    the ended batch names one output file, and the tenant lists no other."""
    from tokenfleet.batches import ends as batch_ends
    from tokenfleet.batches import output as batch_output
    from tokenfleet.client.batch_records import read_record
    from tokenfleet.files.records import list_files

    settings = settings.model_copy(update={"files_url": f"file://{tmp_path}/files"})

    async def finalizing(client: AsyncFleetClient) -> Any:
        batch = await client.submit_batch([completion_line(0)])
        store = open_store(settings.files_url)
        batch_output.write_part(store, batch.id, "out", 1, [(0, b'{"custom_id": "c-0"}')])
        await client.redis.hset(client.keys.batch(batch.id), mapping={
            "status": '"finalizing"', "ending": "completed", "parts": 1, "total": 1,
            "completed": 1})
        return await read_record(client.redis, client.keys, batch.id)

    async def main() -> None:
        async with AsyncFleetClient(settings=settings) as client:
            store = open_store(settings.files_url)
            record = await finalizing(client)
            move = batch_ends.batch_move

            def stopped(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("the driver stopped here")
            monkeypatch.setattr(batch_ends, "batch_move", stopped)
            with pytest.raises(RuntimeError):
                await batch_ends.finalize(client, store, record)  # registered, not ended
            monkeypatch.setattr(batch_ends, "batch_move", move)
            await asyncio.gather(batch_ends.finalize(client, store, record),
                                 batch_ends.finalize(client, store, record))
            done = await read_record(client.redis, client.keys, record.batch.id)
            assert done is not None and done.batch.status == "completed"
            outputs = await list_files(client.redis, client.keys, None,
                                       purpose="batch_output")
            assert [f.id for f in outputs] == [done.batch.output_file_id]
            assert [line["custom_id"] async for line in
                    client.batch_results(record.batch.id)] == ["c-0"]
            assert not [f for f in await client.redis.hkeys(client.keys.batch(record.batch.id))
                        if f.startswith(b"made:")]

    asyncio.run(main())


def test_a_line_collected_twice_is_counted_once(settings: Settings) -> None:
    """Two drivers (a lease that lapsed) or one after a crash collect the same
    line: it counts once, so the batch does not end before every line is done."""
    from tokenfleet.shared.wire.batch_scripts import batch_done

    r, keys = redis_client(settings.redis_url), Keys(settings.namespace)
    r.hset(keys.batch("batch_x"), mapping={"completed": 0, "failed": 0, "tokens": 0})
    r.hset(keys.batch_running("batch_x"), mapping={0: "default:a", 1: "default:b"})
    assert batch_done(keys, "batch_x", [(0, "out", 5), (1, "err", 0)]).run(r) == 2
    assert batch_done(keys, "batch_x", [(0, "out", 5), (1, "out", 3)]).run(r) == 0
    assert r.hmget(keys.batch("batch_x"), "completed", "failed", "tokens") == [b"1", b"1", b"5"]
    # Still running: a line leaves that hash once its job's keys are let go.
    assert r.hlen(keys.batch_running("batch_x")) == 2
    r.close()


def test_a_driver_stopped_after_marking_lines_done_leaves_no_token_log_behind(
    settings: Settings, start_worker: Any, tmp_path: Any
) -> None:
    """Driver a writes and marks lines done, then stops before it lets their
    jobs go (a power cut between the two): driver b lets them go, so no token
    log of a written line stays in Redis, and each line counts once."""
    from tokenfleet.batches.driver import BatchDriver

    settings = settings.model_copy(update={"files_url": f"file://{tmp_path}/files",
                                           "batch_window": 3})
    start_worker()

    class Stopped(Exception):
        pass

    async def main() -> None:
        async with AsyncFleetClient(settings=settings) as client:
            keys, store = client.keys, open_store(settings.files_url)
            batch = await client.submit_batch([completion_line(i) for i in range(6)])
            a = BatchDriver(client, store, name="a", lease_ms=300, step_s=0.05)
            marked: dict[int, str] = {}

            async def stop(batch_id: str, jobs: dict[int, str]) -> None:
                if jobs:
                    marked.update(jobs)
                    raise Stopped

            a._let_go = stop  # type: ignore[method-assign]
            with pytest.raises(Stopped):
                while True:
                    await a.step_batch(batch.id)
                    await asyncio.sleep(0.05)
            assert marked and all(await asyncio.gather(
                *(client.redis.exists(keys.out(j)) for j in marked.values())))
            await client.redis.delete(keys.batch_lease(batch.id))  # a's lease lapsed

            b = BatchDriver(client, store, name="b", lease_ms=300, step_s=0.05)
            done = await b.drive(batch.id, timeout=60)
            assert done.batch.status == "completed"
            assert done.batch.request_counts.completed == 6
            lines = [line async for line in client.batch_results(batch.id)]
            jobs = [line["response"]["request_id"] for line in lines]
            assert sorted(line["custom_id"] for line in lines) == [f"c-{i}" for i in range(6)]
            assert set(marked.values()) <= set(jobs)
            assert sum([await client.redis.exists(keys.out(j)) for j in jobs]) == 0

    asyncio.run(main())


def test_another_tenants_batch_and_input_file_are_404(fleet: dict[str, Any]) -> None:
    oa, other = fleet["oa"], fleet["other"]
    file_id = upload(fleet, jsonl([completion_line(0)]))
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                             completion_window="24h")
    batch = oa.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                              completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    assert batch.id not in [b.id for b in other.batches.list().data]
    assert ended(oa, batch.id).status == "completed"
    with pytest.raises(openai.BadRequestError) as refused:
        oa.batches.create(input_file_id=file_id, endpoint="/v1/embeddings",
                          completion_window="24h")
    assert "endpoint" in refused.value.message
    with pytest.raises(openai.BadRequestError) as window:
        oa.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                          completion_window="2d")  # type: ignore[arg-type]
    assert "completion_window" in window.value.message


def test_the_cli_submits_waits_writes_the_results_and_lists(
    fleet: dict[str, Any], tmp_path: Any
) -> None:
    from click.testing import CliRunner

    from tokenfleet.cli.app import main

    settings = fleet["settings"]
    env = {"TOKENFLEET_REDIS_URL": settings.redis_url,
           "TOKENFLEET_NAMESPACE": settings.namespace,
           "TOKENFLEET_FILES_URL": settings.files_url}
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl([chat_line(i) for i in range(5)]))
    out = tmp_path / "out.jsonl"
    runner = CliRunner(env=env)
    ran = runner.invoke(main, ["batch", "submit", str(source), "--wait", "--output", str(out),
                               "--tenant", "acme"], catch_exceptions=False)
    assert ran.exit_code == 0, ran.output
    batch_id = ran.output.splitlines()[0]
    assert batch_id.startswith("batch_")
    # Piped, the progress is plain lines; the last one says it completed.
    assert f"{batch_id} completed: 5 done / 0 failed / 5 total" in ran.output
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"m-{i}" for i in range(5)]
    assert fleet["oa"].batches.retrieve(batch_id).status == "completed"

    status = runner.invoke(main, ["batch", "status", batch_id, "--tenant", "acme"])
    assert status.exit_code == 0 and "completed: 5 done" in status.output
    listed = runner.invoke(main, ["batch", "list", "--tenant", "acme"])
    assert listed.exit_code == 0 and batch_id in listed.output
    missing = runner.invoke(main, ["batch", "status", batch_id])  # the default tenant's: none
    assert missing.exit_code == 1 and "no batch" in missing.output
    cancelled = runner.invoke(main, ["batch", "cancel", batch_id, "--tenant", "acme"])
    assert cancelled.exit_code == 0 and "completed" in cancelled.output  # ended: unchanged


def test_a_stopped_drivers_batch_is_taken_over_and_each_line_runs_once(
    settings: Settings, start_worker: Any, tmp_path: Any
) -> None:
    """Driver a feeds part of a batch and stops without a word (a killed gateway);
    driver b takes the batch over when a's lease lapses: the lines a queued are
    the same jobs (their idempotency keys), and a part written twice (a crash
    between a part and its marks) yields each line once."""
    from tokenfleet.batches import output as batch_output
    from tokenfleet.batches.driver import BatchDriver

    settings = settings.model_copy(update={"files_url": f"file://{tmp_path}/files",
                                           "batch_window": 3})
    start_worker()

    async def main() -> None:
        async with AsyncFleetClient(settings=settings) as client:
            store = open_store(settings.files_url)
            batch = await client.submit_batch([completion_line(i) for i in range(8)])
            a = BatchDriver(client, store, name="a", lease_ms=300, step_s=0.05)
            keys = client.keys
            while True:  # until a has lines done and lines running
                await a.step()
                record = await client.redis.hgetall(keys.batch(batch.id))
                if int(record.get(b"completed", 0)) >= 2 and await client.redis.hlen(
                        keys.batch_running(batch.id)):
                    break
                await asyncio.sleep(0.05)
            queued_by_a = {int(k): v.decode() for k, v in
                           (await client.redis.hgetall(keys.batch_running(batch.id))).items()}
            # A part written again, as after a crash before its lines were marked done.
            again = await client.redis.hincrby(keys.batch(batch.id), "parts", 1)
            first = b"".join(store.read(batch_output.part_name(batch.id, "out", 1)))
            store.put(batch_output.part_name(batch.id, "out", again), [first])

            b = BatchDriver(client, store, name="b", lease_ms=300, step_s=0.05)
            done = await b.drive(batch.id, timeout=60)
            assert done.batch.status == "completed"
            assert done.batch.request_counts.completed == 8
            lines = [line async for line in client.batch_results(batch.id)]
            assert sorted(line["custom_id"] for line in lines) == sorted(
                f"c-{i}" for i in range(8))
            job_of = {int(line["custom_id"][2:]): line["response"]["request_id"]
                      for line in lines}
            assert len(set(job_of.values())) == 8
            for index, job_id in queued_by_a.items():
                assert job_of[index] == job_id  # b found a's job, made none again
            assert not store.exists(batch_output.part_name(batch.id, "out", 1))  # parts gone

    asyncio.run(main())


@pytest.mark.slow
def test_an_async_stream_of_generation_requests_is_a_chat_batch(fleet: dict[str, Any]) -> None:
    from tokenfleet import GenerationRequest

    async def requests() -> Any:
        for prompt in PROMPTS:
            yield GenerationRequest(messages=[{"role": "user", "content": prompt}],
                                    sampling={"max_new_tokens": 4, "temperature": 0.0})

    async def main() -> list[dict[str, Any]]:
        async with AsyncFleetClient(settings=fleet["settings"]) as client:
            batch = await client.submit_batch(requests(), metadata={"run": "async"})
            assert batch.endpoint == "/v1/chat/completions"
            while not (await client.batch(batch.id)).is_ended:
                await asyncio.sleep(0.1)
            assert (await client.batch(batch.id)).status == "completed"
            return [line async for line in client.batch_results(batch.id, order="input")]

    lines = asyncio.run(main())
    assert [line["custom_id"] for line in lines] == [f"request-{i}" for i in range(4)]
    client: FleetClient = fleet["client"]
    for prompt, line in zip(PROMPTS, lines):
        single = client.wait(client.submit(messages=[{"role": "user", "content": prompt}],
                                           max_new_tokens=4, temperature=0.0), timeout=60)
        assert line["response"]["body"]["choices"][0]["message"]["content"] == single.text
