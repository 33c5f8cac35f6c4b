"""A ``multipart/form-data`` body read as a stream of events, never held whole
(an upload may carry a 200 MB file).

``form_events(body, boundary)`` yields, in the order the body brings them, a
:class:`Part` once a part's headers are read, then its data (``bytes``, as it
arrives), then :data:`PART_END`. ``part_data`` and ``read_field`` take one part's
data from there: the first as a stream, the second whole but bounded.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Final

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

# A plain field (``purpose``) is a word: anything longer is no purpose.
MAX_FIELD_BYTES = 1024


class FormError(ValueError):
    """The body is not the form asked for; the message says what to send."""


class UploadTooLarge(FormError):
    def __init__(self, limit: int, file_limit: int) -> None:
        super().__init__(
            f"upload: the request body is over {limit} bytes, the most an upload may send "
            f"(a file of at most {file_limit} bytes and its form fields)")


@dataclass(frozen=True)
class Part:
    name: str
    filename: str | None


class _End:
    def __repr__(self) -> str:
        return "PART_END"


PART_END: Final = _End()
Event = Part | bytes | _End


def boundary_of(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` Content-Type."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise FormError("send the upload as multipart/form-data with the fields 'file' (the "
                        "JSONL file) and 'purpose' ('batch')")
    return boundary


async def bounded(body: AsyncIterable[bytes], limit: int,
                  too_large: Callable[[], Exception]) -> AsyncGenerator[bytes, None]:
    """``body``, raising ``too_large()`` once more than ``limit`` bytes came."""
    size = 0
    async for chunk in body:
        size += len(chunk)
        if size > limit:
            raise too_large()
        yield chunk


async def form_events(body: AsyncIterable[bytes], boundary: bytes
                      ) -> AsyncGenerator[Event, None]:
    """The events of the form in ``body`` (see the module's docstring)."""
    events: list[Event] = []
    headers: dict[bytes, bytes] = {}
    field, value = bytearray(), bytearray()

    def on_part_begin() -> None:
        headers.clear()

    def on_header_field(data: bytes, start: int, end: int) -> None:
        field.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        value.extend(data[start:end])

    def on_header_end() -> None:
        headers[bytes(field).lower()] = bytes(value)
        field.clear()
        value.clear()

    def on_headers_finished() -> None:
        _, options = parse_options_header(headers.get(b"content-disposition", b""))
        filename = options.get(b"filename")
        events.append(Part(options.get(b"name", b"").decode(errors="replace"),
                           None if filename is None else filename.decode(errors="replace")))

    def on_part_data(data: bytes, start: int, end: int) -> None:
        events.append(data[start:end])

    def on_part_end() -> None:
        events.append(PART_END)

    callbacks: Any = {
        "on_part_begin": on_part_begin, "on_header_field": on_header_field,
        "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished, "on_part_data": on_part_data,
        "on_part_end": on_part_end}
    parser = MultipartParser(boundary, callbacks)
    try:
        async for chunk in body:
            parser.write(chunk)
            # Handed on before the next chunk is read: at most one chunk's worth waits.
            for event in events:
                yield event
            events.clear()
        parser.finalize()
    except MultipartParseError as exc:
        raise FormError(f"the body is not a well-formed multipart/form-data form ({exc})"
                        ) from None
    for event in events:
        yield event


async def part_data(events: AsyncIterator[Event]) -> AsyncGenerator[bytes, None]:
    """The data of the current part, up to its end."""
    async for event in events:
        if event is PART_END:
            return
        if isinstance(event, bytes):
            yield event
    raise FormError("the body ended inside a part of the form")


async def read_field(events: AsyncIterator[Event], name: str) -> str:
    """The value of the current part, a plain field of at most ``MAX_FIELD_BYTES``."""
    value = bytearray()
    async for chunk in part_data(events):
        value += chunk
        if len(value) > MAX_FIELD_BYTES:
            raise FormError(f"{name}: over {MAX_FIELD_BYTES} bytes, more than this field holds")
    return value.decode(errors="replace")
