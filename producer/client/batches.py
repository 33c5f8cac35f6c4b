"""Batches from Python: ``client.submit_batch(requests)``, ``client.batch(id)``,
``client.batch_results(id)``, ``client.cancel_batch(id)``.

The requests are streamed into the file store as the batch's input file (the
client never holds them all), then the batch is recorded; a batch driver runs
it: every gateway runs one, and ``tokenfleet batch drive`` runs one without a
gateway. Requests are dicts as a batch file's lines hold them (``custom_id``
and ``body``; ``method`` and ``url`` may be left out) or ``GenerationRequest``s
(their custom_id is ``request-<n>``, n counting from 0), stored as they are under
``request`` in place of ``body``: the batch driver makes the endpoint's body of
each (``tokenfleet.openai.translate.to_body``; a field a body cannot carry fails
the line, naming it).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any, Literal

import orjson

from tokenfleet.client.batch_records import (
    Batch,
    cancel_batch,
    create_batch,
    get_batch,
)
from tokenfleet.files.records import create_file, max_line_bytes, store_name
from tokenfleet.client.protocol import check_webhook_destination
from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.file_store import FileStore, open_store, read_lines
from tokenfleet.shared.wire.schemas import GenerationRequest

Request = dict[str, Any] | GenerationRequest
Order = Literal["input", "finished"]
UPLOAD_CHUNK = 1 << 16
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def endpoint_of(request: Request) -> str:
    """The endpoint a request goes to: its url, else chat for messages."""
    if isinstance(request, GenerationRequest):
        return CHAT if request.messages is not None else COMPLETIONS
    if "url" in request:
        return str(request["url"])
    asked = request.get("body") or request.get("request") or {}
    return CHAT if "messages" in asked else COMPLETIONS


def line_of(index: int, request: Request, endpoint: str) -> bytes:
    if isinstance(request, GenerationRequest):
        # Stored as it is: the batch driver makes the endpoint's body of it
        # (``tokenfleet.openai.translate.to_body``).
        line: dict[str, Any] = {"custom_id": f"request-{index}",
                                "request": request.model_dump(mode="json", exclude_defaults=True)}
    else:
        line = dict(request)
    line.setdefault("method", "POST")
    line.setdefault("url", endpoint)
    return orjson.dumps(line) + b"\n"


async def submit_batch(client: Any, requests: Iterable[Request] | AsyncIterable[Request], *,
                       endpoint: str | None = None, completion_window: str = "24h",
                       metadata: dict[str, str] | None = None, tenant: str | None = None,
                       store: FileStore | None = None) -> Batch:
    """Stream ``requests`` into the store as a batch's input, then create the batch."""
    if metadata and isinstance(metadata.get("webhook_url"), str):
        check_webhook_destination(metadata["webhook_url"], client.settings,
                                  "metadata.webhook_url")
    store = store or open_store(client.settings.files_url)
    source = _aiter(requests)
    first = await anext(source, None)
    if first is None:
        raise InvalidRequest("a batch needs at least one request")
    endpoint = endpoint or endpoint_of(first)

    async def chunks() -> AsyncIterator[bytes]:
        # Lines go to the store's thread in chunks, not one by one: each hand-over
        # is a round trip between the threads.
        assert first is not None and endpoint is not None
        chunk = bytearray(line_of(0, first, endpoint))
        index = 1
        async for request in source:
            chunk += line_of(index, request, endpoint)
            index += 1
            if len(chunk) >= UPLOAD_CHUNK:
                yield bytes(chunk)
                chunk.clear()
        if chunk:
            yield bytes(chunk)

    file = await create_file(client.redis, client.keys, store, chunks(),
                             filename="batch_input.jsonl", purpose="batch", tenant=tenant,
                             max_files=client.settings.files_max_per_tenant,
                             max_line=max_line_bytes(client.settings.max_payload_bytes))
    return await create_batch(client.redis, client.keys, input_file_id=file.id,
                              endpoint=endpoint, completion_window=completion_window,
                              metadata=metadata, tenant=tenant,
                              max_open=client.settings.batch_max_open)


async def _aiter(requests: Iterable[Request] | AsyncIterable[Request]
                 ) -> AsyncIterator[Request]:
    if isinstance(requests, AsyncIterable):
        async for request in requests:
            yield request
    else:
        for request in requests:
            yield request


async def batch(client: Any, batch_id: str, tenant: str | None = None) -> Batch:
    found = await get_batch(client.redis, client.keys, batch_id, tenant)
    if found is None:
        raise KeyError(f"no batch {batch_id!r}")
    return found


async def cancel(client: Any, batch_id: str, tenant: str | None = None) -> Batch:
    found = await cancel_batch(client.redis, client.keys, batch_id, tenant)
    if found is None:
        raise KeyError(f"no batch {batch_id!r}")
    return found


def results(store: FileStore, found: Batch, order: Order = "finished"
            ) -> Iterator[dict[str, Any]]:
    """The batch's result lines (its output file's, then its error file's), in
    the order they finished, streamed; or, with ``order="input"``, in its
    input's order: the result files hold no line number, so their lines are
    held in memory (as their bytes) to be sorted. Blocking."""
    files = [f for f in (found.output_file_id, found.error_file_id) if f]
    lines = (line for f in files for line in read_lines(store, store_name(f)) if line.strip())
    if order == "finished":
        yield from (orjson.loads(line) for line in lines)
        return
    # By custom_id, in the files' order: a duplicate custom_id (or none) names
    # more than one line, each given to the next input line that names it.
    by_id: dict[str | None, deque[bytes]] = {}
    for line in lines:
        by_id.setdefault(custom_id_of(line), deque()).append(line)
    for raw in read_lines(store, store_name(found.input_file_id)):
        if raw.strip():
            waiting = by_id.get(custom_id_of(raw))
            if waiting:
                yield orjson.loads(waiting.popleft())
    for rest in by_id.values():  # lines whose custom_id the input does not give
        yield from (orjson.loads(line) for line in rest)


def custom_id_of(raw: bytes) -> str | None:
    """A line's custom_id; None for a line that is not JSON or names none."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


async def aresults(client: Any, batch_id: str, order: Order = "finished",
                   tenant: str | None = None) -> AsyncIterator[dict[str, Any]]:
    found = await batch(client, batch_id, tenant)
    lines = results(open_store(client.settings.files_url), found, order)
    while chunk := await asyncio.to_thread(_take, lines, 256):
        for line in chunk:
            yield line


def _take(lines: Iterator[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        out.append(line)
        if len(out) >= n:
            break
    return out
