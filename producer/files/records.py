"""Files: OpenAI's file objects, their bytes in the file store and their records in Redis.

A file's bytes go to the store (``shared/file_store.py``) as they arrive, never
held whole; its record (``<ns>:file:<id>``, a hash) holds what OpenAI's file
object shows plus its tenant. Uploads are checked while they stream: a file
over the limits is refused with the limit named, and nothing of it is kept.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import AsyncIterable, Iterable, Iterator
from typing import Any, Literal

from pydantic import BaseModel

from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.file_store import FileStore
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.ownership import tenant_or_default

# OpenAI's limits on a batch's input file.
MAX_FILE_BYTES = 200 * 1000 * 1000
MAX_BATCH_LINES = 50_000

Purpose = Literal["batch", "batch_output"]
PURPOSES: tuple[str, ...] = ("batch", "batch_output")


class FileObject(BaseModel):
    """OpenAI's file object (``GET /v1/files/{id}``)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def store_name(file_id: str) -> str:
    """Where a file's bytes live in the store."""
    return f"files/{file_id}"


# A batch line holds a request (``TOKENFLEET_MAX_PAYLOAD_BYTES``) and its
# custom_id, method and url: room for those beside the largest request.
LINE_ENVELOPE = 64 << 10
# A character that makes a line not blank, and the rest of its line: one match a line.
NOT_BLANK = re.compile(rb"\S[^\n]*")


def max_line_bytes(max_payload_bytes: int) -> int:
    """The longest batch line: the largest request, in its envelope."""
    return max_payload_bytes + LINE_ENVELOPE


class _Checked:
    """Counts a stream of chunks as it passes, refusing it past the limits:
    its bytes; for a batch's input, its lines that are not blank and the
    length of each line (checked as it streams, so a line too long is refused
    at the limit, not at its end)."""

    def __init__(self, purpose: str, max_bytes: int, max_lines: int,
                 max_line: int | None = None) -> None:
        self.purpose, self.max_bytes, self.max_lines = purpose, max_bytes, max_lines
        self.max_line = max_line
        self.size = 0
        self.lines = 0  # lines not blank, each counted at its first non-blank byte
        self._line = 0  # the bytes of the line so far
        self._counted = False  # whether the line so far is counted

    def check(self, chunk: bytes) -> bytes:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise InvalidRequest(
                f"file: over {self.max_bytes} bytes, the most a file may hold")
        if chunk and self.purpose == "batch":
            self._count(chunk)
            if self.lines > self.max_lines:
                raise InvalidRequest(
                    f"file: over {self.max_lines} lines, the most requests a batch may hold "
                    "(blank lines not counted)")
        return chunk

    def _count(self, chunk: bytes) -> None:
        # Split and searched in C: a Python loop a line would take seconds on
        # a file of 200 MB of blank lines.
        pieces = chunk.split(b"\n")  # the first continues the line so far
        if len(pieces) == 1:
            self._line += len(chunk)
            longest = self._line
        else:
            longest = max(self._line + len(pieces[0]), max(map(len, pieces[1:])))
            self._line = len(pieces[-1])
        if self.max_line is not None and longest > self.max_line:
            raise InvalidRequest(
                f"file: a line is over {self.max_line} bytes, the most a batch line may hold "
                "(a request's TOKENFLEET_MAX_PAYLOAD_BYTES and 64 KiB for its custom_id, method "
                "and url)")
        start = 0
        if self._counted:
            if len(pieces) == 1:
                return
            start = len(pieces[0]) + 1
        found = len(NOT_BLANK.findall(chunk, start))
        self.lines += found
        self._counted = (bool(pieces[-1].strip()) if len(pieces) > 1
                         else self._counted or found > 0)


def _record(file: FileObject, tenant: str | None) -> dict[str, str]:
    return {"object": file.model_dump_json(), "tenant": tenant_or_default(tenant)}


def write_file(store: FileStore, chunks: Iterable[bytes], *, filename: str, purpose: str,
               max_bytes: int = MAX_FILE_BYTES, max_lines: int = MAX_BATCH_LINES,
               max_line: int | None = None) -> FileObject:
    """Stream ``chunks`` into the store under a new id (blocking: run it in a
    thread from a coroutine). Nothing is registered yet: ``register`` does that.
    ``max_line``: the longest line of a batch's input (``max_line_bytes``)."""
    if purpose not in PURPOSES:
        raise InvalidRequest(f"purpose: must be one of {', '.join(PURPOSES)}, got {purpose!r}")
    checked = _Checked(purpose, max_bytes, max_lines, max_line)
    file_id = new_file_id()

    def passing() -> Iterator[bytes]:
        for chunk in chunks:
            yield checked.check(chunk)

    try:
        size = store.put(store_name(file_id), passing())
    except InvalidRequest:
        store.delete(store_name(file_id))
        raise
    return FileObject(id=file_id, bytes=size, created_at=int(time.time()),
                      filename=filename, purpose=purpose)


async def register(client: Any, keys: Keys, file: FileObject, tenant: str | None) -> None:
    """Record a written file, so that it can be read, listed and deleted."""
    pipe = client.pipeline(transaction=False)
    pipe.hset(keys.file(file.id), mapping=_record(file, tenant))
    pipe.zadd(keys.files, {file.id: file.created_at})
    pipe.zadd(keys.tenant_files(tenant_or_default(tenant)), {file.id: file.created_at})
    await pipe.execute()


async def check_room(client: Any, keys: Keys, tenant: str | None, max_files: int) -> None:
    """Refuse an upload of a tenant that holds ``max_files`` files already
    (``TOKENFLEET_FILES_MAX_PER_TENANT``). Checked as an upload starts: uploads
    at once may pass it by a few, never by more than there are at once."""
    owner = tenant_or_default(tenant)
    held = await client.zcard(keys.tenant_files(owner))
    if held >= max_files:
        raise InvalidRequest(
            f"file: tenant {owner!r} holds {held} files, the most a tenant may hold "
            f"(TOKENFLEET_FILES_MAX_PER_TENANT {max_files}); delete some (DELETE "
            "/v1/files/{id}) before uploading more")


async def store_file(store: FileStore, chunks: AsyncIterable[bytes] | Iterable[bytes], *,
                     filename: str, purpose: str, max_bytes: int = MAX_FILE_BYTES,
                     max_lines: int = MAX_BATCH_LINES, max_line: int | None = None
                     ) -> FileObject:
    """``write_file`` from a coroutine: the store runs in a thread; an async body
    is pulled from this loop chunk by chunk as the store takes it."""
    if isinstance(chunks, AsyncIterable):
        loop = asyncio.get_running_loop()
        source = chunks.__aiter__()

        def pulled() -> Iterator[bytes]:
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(
                        source.__anext__(), loop).result()  # type: ignore[arg-type]
                except StopAsyncIteration:
                    return

        blocking: Iterable[bytes] = pulled()
    else:
        blocking = chunks
    return await asyncio.to_thread(write_file, store, blocking, filename=filename,
                                   purpose=purpose, max_bytes=max_bytes, max_lines=max_lines,
                                   max_line=max_line)


async def create_file(client: Any, keys: Keys, store: FileStore,
                      chunks: AsyncIterable[bytes] | Iterable[bytes], *, filename: str,
                      purpose: str, tenant: str | None, max_files: int | None = None,
                      max_line: int | None = None) -> FileObject:
    """Upload: stream ``chunks`` into the store, then record the file. Refused
    when the tenant holds ``max_files`` files, or a line is over ``max_line``."""
    if max_files is not None:
        await check_room(client, keys, tenant, max_files)
    file = await store_file(store, chunks, filename=filename, purpose=purpose,
                            max_line=max_line)
    await register(client, keys, file, tenant)
    return file


async def get_file(client: Any, keys: Keys, file_id: str,
                   tenant: str | None) -> FileObject | None:
    """The file, or None when there is none or it is another tenant's."""
    record = await client.hgetall(keys.file(file_id))
    if not record:
        return None
    record = {_text(k): _text(v) for k, v in record.items()}
    if record.get("tenant") != tenant_or_default(tenant):
        return None
    return FileObject.model_validate_json(record["object"])


async def list_files(client: Any, keys: Keys, tenant: str | None, *, purpose: str | None = None,
                     limit: int = 10_000) -> list[FileObject]:
    """The tenant's files, newest first: read from its own index, so no other
    tenant's record is read."""
    ids = await client.zrevrange(keys.tenant_files(tenant_or_default(tenant)), 0, -1)
    found: list[FileObject] = []
    for file_id in ids:
        file = await get_file(client, keys, _text(file_id), tenant)
        if file is not None and (purpose is None or file.purpose == purpose):
            found.append(file)
            if len(found) >= limit:
                break
    return found


async def delete_file(client: Any, keys: Keys, store: FileStore, file_id: str,
                      tenant: str | None) -> bool:
    """Delete the tenant's file: its record first (so nobody reads a file being
    removed), then its bytes. False when there was none to delete."""
    if await get_file(client, keys, file_id, tenant) is None:
        return False
    pipe = client.pipeline(transaction=False)
    pipe.delete(keys.file(file_id))
    pipe.zrem(keys.files, file_id)
    pipe.zrem(keys.tenant_files(tenant_or_default(tenant)), file_id)
    await pipe.execute()
    await asyncio.to_thread(store.delete, store_name(file_id))
    return True


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
