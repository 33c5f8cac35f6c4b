"""OpenAI's Files API on the gateway: ``/v1/files``.

- ``POST /v1/files`` (a multipart form: ``file``, ``purpose`` ``batch``): the file
  streams into the store (``TOKENFLEET_FILES_URL``) as it arrives, checked on the
  way (``tokenfleet.files.records``: 200 MB, 50,000 lines not blank, each line at most a
  request's payload limit and 64 KiB); the answer is its file object. A tenant
  holding ``TOKENFLEET_FILES_MAX_PER_TENANT`` files is refused before its body is read.
- ``GET /v1/files`` (``purpose``, ``limit``, ``after``, ``order``), ``GET /v1/files/{id}``,
  ``DELETE /v1/files/{id}``, ``GET /v1/files/{id}/content`` (streamed from the store).

This is the one route whose body is not held to ``TOKENFLEET_MAX_PAYLOAD_BYTES``
(a request's JSON): an upload may send a whole file, so its body is bounded by the
file limit plus a little for the form (``upload_limit``), counted as it streams,
and never held whole. Its time limit is the gateway's (``TOKENFLEET_BODY_TIMEOUT_S``).

A file belongs to the tenant of the key that uploaded it: another tenant's id is
a 404, as an unknown one is. Every refusal is a row of ``tokenfleet.openai.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from tokenfleet.files import records as files
from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.gateway.error_response import error_response
from tokenfleet.gateway.auth import caller_tenant
from tokenfleet.files.records import FileObject
from tokenfleet.openai.errors import FILE_NOT_FOUND, INVALID_VALUE, Refusal
from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.file_store import FileStore, store_for
from tokenfleet.gateway.tenant_refusals import note
from tokenfleet.files.upload_form import (Event, FormError, Part, UploadTooLarge, boundary_of, bounded,
                                    form_events, part_data, read_field)

router = APIRouter()

# What a form adds to its file: boundaries, part headers, the purpose field.
FORM_BYTES = 64 << 10
UPLOAD_PURPOSE = "batch"
MAX_LIST = 10_000
ORDERS = ("asc", "desc")


def upload_limit() -> int:
    """The most bytes an upload's body may send (read at each upload, as the limits are)."""
    return files.MAX_FILE_BYTES + FORM_BYTES


def _fleet(request: Request) -> AsyncFleetClient:
    return cast(AsyncFleetClient, request.app.state.fleet)


def _store(request: Request) -> FileStore:
    return store_for(_fleet(request).settings.files_url)


def _refuse(request: Request, refusal: Refusal, message: str, *, param: str | None = None,
            headers: dict[str, str] | None = None) -> Response:
    note(request.state, refusal)  # the reason a tenant's refusal is counted under
    return error_response(refusal.error(message, param=param, headers=headers))


def _not_found(request: Request, file_id: str) -> Response:
    return _refuse(request, FILE_NOT_FOUND, f"no file {file_id!r}: never uploaded, or deleted",
                   param="id")


@router.post("/v1/files")
async def upload(request: Request) -> Response:
    max_bytes, max_lines, limit = files.MAX_FILE_BYTES, files.MAX_BATCH_LINES, upload_limit()
    try:
        boundary = boundary_of(request.headers.get("content-type", ""))
    except FormError as exc:
        return _refuse(request, INVALID_VALUE, str(exc))
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        # Refused before a byte of it is read: the connection cannot be reused.
        return _refuse(request, INVALID_VALUE, str(UploadTooLarge(limit, max_bytes)),
                       param="file", headers={"Connection": "close"})
    fleet = _fleet(request)
    try:
        await files.check_room(fleet.redis, fleet.keys, caller_tenant(request.state),
                               fleet.settings.files_max_per_tenant)
    except InvalidRequest as exc:  # refused before a byte of it is read
        return _refuse(request, INVALID_VALUE, str(exc), param="file",
                       headers={"Connection": "close"})
    body = bounded(request.stream(), limit, lambda: UploadTooLarge(limit, max_bytes))
    store = _store(request)
    max_line = files.max_line_bytes(fleet.settings.max_payload_bytes)
    try:
        file = await _receive(store, form_events(body, boundary), max_bytes, max_lines,
                              max_line)
    except ClientDisconnect:
        return Response(status_code=400)  # nobody is left to read it
    except (FormError, InvalidRequest) as exc:
        # Read the rest, so that the client, still sending, reads this answer.
        whole = await _drain(body)
        message = str(exc)
        return _refuse(request, INVALID_VALUE, message, param=_field_of(message),
                       headers=None if whole else {"Connection": "close"})
    try:
        await files.register(fleet.redis, fleet.keys, file, caller_tenant(request.state))
    except BaseException:  # Redis out of reach: no file nobody can list or delete
        await asyncio.to_thread(store.delete, files.store_name(file.id))
        raise
    return JSONResponse(file.model_dump())


async def _receive(store: FileStore, events: AsyncGenerator[Event, None], max_bytes: int,
                   max_lines: int, max_line: int) -> FileObject:
    """The form's file, written to the store; its purpose checked once the form is read
    (a client may send it after the file: then the file is removed if it is wrong)."""
    purpose: str | None = None
    file: FileObject | None = None
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                if not isinstance(event, Part):
                    continue
                if event.name != "file":
                    value = await read_field(events, event.name)
                    if event.name == "purpose":
                        purpose = _purpose(value)
                    continue
                if file is not None:
                    raise FormError("file: one file an upload; send the others one by one")
                async with contextlib.aclosing(part_data(events)) as data:
                    file = await files.store_file(
                        store, data, filename=event.filename or "upload",
                        purpose=UPLOAD_PURPOSE, max_bytes=max_bytes, max_lines=max_lines,
                        max_line=max_line)
        if file is None:
            raise FormError("file: missing; send the JSONL file in the form's field 'file'")
        if purpose is None:
            raise FormError(f"purpose: missing; send the field 'purpose' ({UPLOAD_PURPOSE!r})")
    except BaseException:
        if file is not None:
            await asyncio.to_thread(store.delete, files.store_name(file.id))
        raise
    return file


def _field_of(message: str) -> str | None:
    """The form field a refusal is about: its message names it first (``file: over ...``)."""
    field = message.split(":", 1)[0]
    return field if field in ("file", "purpose") else None


def _purpose(value: str) -> str:
    if value != UPLOAD_PURPOSE:
        raise FormError(f"purpose: an upload's purpose must be {UPLOAD_PURPOSE!r}, got {value!r}")
    return value


async def _drain(body: Any) -> bool:
    """Read what is left of the body; False if it did not come whole (too large, gone)."""
    try:
        async for _ in body:
            pass
    except (UploadTooLarge, ClientDisconnect):
        return False
    return True


@router.get("/v1/files")
async def list_files(request: Request) -> Response:
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ORDERS:
        return _refuse(request, INVALID_VALUE, f"order: must be asc or desc, got {order!r}",
                       param="order")
    limit_text = query.get("limit", str(MAX_LIST))
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST:
        return _refuse(request, INVALID_VALUE,
                       f"limit: must be a whole number from 1 to {MAX_LIST}, got {limit_text!r}",
                       param="limit")
    fleet = _fleet(request)
    found = await files.list_files(fleet.redis, fleet.keys, caller_tenant(request.state),
                                   purpose=query.get("purpose"), limit=MAX_LIST)
    if order == "asc":
        found.reverse()
    after = query.get("after")
    if after is not None:
        ids = [file.id for file in found]
        found = found[ids.index(after) + 1:] if after in ids else []
    page = found[:int(limit_text)]
    return JSONResponse({
        "object": "list", "data": [file.model_dump() for file in page],
        "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
        "has_more": len(found) > len(page)})


@router.get("/v1/files/{file_id}")
async def retrieve(file_id: str, request: Request) -> Response:
    fleet = _fleet(request)
    file = await files.get_file(fleet.redis, fleet.keys, file_id, caller_tenant(request.state))
    if file is None:
        return _not_found(request, file_id)
    return JSONResponse(file.model_dump())


@router.delete("/v1/files/{file_id}")
async def delete(file_id: str, request: Request) -> Response:
    fleet = _fleet(request)
    if not await files.delete_file(fleet.redis, fleet.keys, _store(request), file_id,
                                   caller_tenant(request.state)):
        return _not_found(request, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.get("/v1/files/{file_id}/content")
async def content(file_id: str, request: Request) -> Response:
    fleet = _fleet(request)
    file = await files.get_file(fleet.redis, fleet.keys, file_id, caller_tenant(request.state))
    if file is None:
        return _not_found(request, file_id)
    answer = await file_content(_store(request), file)
    return _not_found(request, file_id) if answer is None else answer


async def file_content(store: FileStore, file: files.FileObject) -> Response | None:
    """The file's bytes as a streamed answer (the API's and the console's
    download), or None when they are gone (deleted since its record was read)."""
    try:
        chunks = await asyncio.to_thread(store.read, files.store_name(file.id))
    except FileNotFoundError:
        return None
    media_type = "application/jsonl" if file.purpose in files.PURPOSES else (
        "application/octet-stream")
    # A blocking iterator: Starlette takes each chunk in a thread.
    return StreamingResponse(chunks, media_type=media_type,
                             headers={"Content-Length": str(file.bytes)})
