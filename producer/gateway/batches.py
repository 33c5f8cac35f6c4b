"""OpenAI-compatible ``/v1/batches`` on the gateway, and the batch driver each
gateway runs (``tokenfleet.batches.driver``).

- ``POST /v1/batches``: ``input_file_id`` (a file of purpose ``batch``, the
  caller's), ``endpoint`` (``/v1/completions`` or ``/v1/chat/completions``),
  ``completion_window`` ("24h"; shorter windows as "<N>h", "<N>m", "<N>s"),
  ``metadata`` (``webhook_url`` in it names where the batch's end is sent);
- ``GET /v1/batches/{id}``, ``GET /v1/batches`` (``after``, ``limit``: OpenAI's
  list), ``POST /v1/batches/{id}/cancel``.

Another tenant's batch or input file reads as missing (404). The lines' models
come from their bodies, as for single requests; an API key limited to some
queues limits its batches' lines to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError
from redis.exceptions import RedisError

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.gateway.error_response import error_response
from tokenfleet.gateway.auth import caller, caller_tenant
from tokenfleet.batches.driver import BatchDriver
from tokenfleet.client.batch_records import Batch, cancel_batch, create_batch, get_batch, list_batches
from tokenfleet.files.records import get_file
from tokenfleet.openai.completions import invalid
from tokenfleet.openai.errors import BATCH_NOT_FOUND, INVALID_VALUE, TOO_LARGE
from tokenfleet.shared.file_store import open_store
from tokenfleet.files.tenant_indexes import index_by_tenant
from tokenfleet.shared.webhook_destination import destination_problem

log = logging.getLogger("tokenfleet.batches")
# A creation names a file and a few fields: its metadata is the most of it.
MAX_BODY = 64 * 1024
router = APIRouter()


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, Any] | None = None


def _client(request: Request) -> AsyncFleetClient:
    fleet: AsyncFleetClient = request.app.state.fleet
    return fleet


def _answer(batch: Batch) -> Response:
    return Response(batch.model_dump_json(), media_type="application/json")


def _missing(what: str, batch_id: str) -> Response:
    return error_response(BATCH_NOT_FOUND.error(
        f"no {what} {batch_id!r}: never made, or another tenant's",
        param="input_file_id" if what == "file" else None))


@router.post("/v1/batches")
async def create(request: Request) -> Response:
    client = _client(request)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            return error_response(TOO_LARGE.error(
                f"request body is larger than {MAX_BODY} bytes, the most a batch's creation "
                "takes (its lines go in its file)"))
    try:
        ask = CreateBatch.model_validate_json(bytes(body))
    except ValidationError as exc:
        return error_response(invalid(exc))
    hook = ask.metadata.get("webhook_url") if isinstance(ask.metadata, dict) else None
    problem = destination_problem(hook, client.settings) if isinstance(hook, str) else None
    if problem:  # checked before anything is made: the batch's end could never land
        return error_response(INVALID_VALUE.error(
            problem.replace("webhook_url", "metadata.webhook_url", 1),
            param="metadata.webhook_url"))
    tenant = caller_tenant(request.state)
    file = await get_file(client.redis, client.keys, ask.input_file_id, tenant)
    if file is None:
        return _missing("file", ask.input_file_id)
    if file.purpose != "batch":
        return error_response(INVALID_VALUE.error(
            f"invalid 'input_file_id': the file's purpose is {file.purpose!r}; a batch's "
            "input has purpose 'batch'", param="input_file_id"))
    key = caller(request.state)
    batch = await create_batch(client.redis, client.keys, input_file_id=file.id,
                               endpoint=ask.endpoint, completion_window=ask.completion_window,
                               metadata=ask.metadata, tenant=tenant,
                               queues=None if key is None else key.queues,
                               max_open=client.settings.batch_max_open)
    driver: BatchDriver | None = getattr(request.app.state, "batch_driver", None)
    if driver is not None:
        driver.wake()
    return _answer(batch)


@router.get("/v1/batches/{batch_id}")
async def retrieve(batch_id: str, request: Request) -> Response:
    client = _client(request)
    batch = await get_batch(client.redis, client.keys, batch_id, caller_tenant(request.state))
    return _missing("batch", batch_id) if batch is None else _answer(batch)


@router.get("/v1/batches")
async def listed(request: Request, after: str | None = None, limit: int = 20) -> Response:
    client = _client(request)
    if not 1 <= limit <= 100:
        return error_response(INVALID_VALUE.error(f"invalid 'limit': {limit}; from 1 to 100",
                                                  param="limit"))
    batches, more = await list_batches(client.redis, client.keys, caller_tenant(request.state),
                                       after=after, limit=limit)
    body = {"object": "list", "data": [b.model_dump(mode="json") for b in batches],
            "first_id": batches[0].id if batches else None,
            "last_id": batches[-1].id if batches else None, "has_more": more}
    return Response(orjson.dumps(body), media_type="application/json")


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel(batch_id: str, request: Request) -> Response:
    client = _client(request)
    batch = await cancel_batch(client.redis, client.keys, batch_id, caller_tenant(request.state))
    return _missing("batch", batch_id) if batch is None else _answer(batch)


@contextlib.asynccontextmanager
async def driving(app: Any) -> AsyncIterator[None]:
    """A batch driver on a task of its own while the block runs (none when the
    file store's URL is unusable: the gateway serves the rest, and says so),
    as ``app.state.batch_driver``."""
    client: AsyncFleetClient = app.state.fleet
    try:
        store = open_store(client.settings.files_url)
    except ValueError as exc:
        log.warning("batches are not run here: %s", exc)
        yield
        return
    with contextlib.suppress(RedisError, OSError):  # tried again at the next start
        copied = await index_by_tenant(client.redis, client.keys)
        if copied:
            log.info("listings: %d files and batches made before the tenants' indexes were "
                     "put in them", copied)
    driver = app.state.batch_driver = BatchDriver(client, store)
    task = asyncio.get_running_loop().create_task(driver.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(RedisError, OSError):
            await driver.release()

