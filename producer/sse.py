"""Server-Sent Events: the one framer of the gateway's streams, and keep-alives.

A stream that sends nothing for a minute (its job waits in the queue) looks dead
to proxies and load balancers, which cut it; and a server learns that its client
hung up only when a write fails. So while nothing else is sent, a comment line
goes out every ``interval`` seconds: clients ignore it, proxies see traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import anyio
from fastapi.responses import StreamingResponse

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keep-alive\n\n"


def event(data: str | bytes, *, name: str | None = None, event_id: int | None = None) -> bytes:
    """One event. ``data`` is compact JSON, so it holds no newline."""
    head = b"" if event_id is None else b"id: %d\n" % event_id
    head += b"" if name is None else f"event: {name}\n".encode()
    body = data.encode() if isinstance(data, str) else data
    return head + b"data: " + body + b"\n\n"


def response(source: AsyncIterable[bytes], keepalive_s: float) -> StreamingResponse:
    return StreamingResponse(with_keepalive(source, keepalive_s),
                             media_type="text/event-stream", headers=HEADERS)


async def with_keepalive(source: AsyncIterable[bytes], interval: float) -> AsyncIterator[bytes]:
    """``source``'s frames, and ``KEEPALIVE`` after every ``interval`` s without one.

    The source's next frame is awaited in a task of its own, so that a keep-alive
    does not cancel it half-way. That task is outside the cancel scope of the
    request: when the request ends (its client hung up, or the response is
    complete) it is cancelled here, through a cancel scope of its own. A scope,
    not ``Task.cancel()``: Python 3.11's ``asyncio.wait_for`` loses a cancel that
    comes as the awaited future completes (the source would then run on for good,
    its subscription with it), and a scope cancels again at every await until the
    task has left it; it also leaves the source's shielded cleanup alone.
    """
    frames = aiter(source)
    pending: asyncio.Future[bytes | None] | None = None
    scope = anyio.CancelScope()
    try:
        while True:
            if pending is None:
                scope = anyio.CancelScope()
                pending = asyncio.ensure_future(_next_frame(frames, scope))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            ready, pending = pending, None
            try:
                frame = ready.result()
            except StopAsyncIteration:
                return
            if frame is not None:
                yield frame
    finally:
        if pending is not None:
            scope.cancel()
            pending.add_done_callback(_retrieve)
        elif (aclose := getattr(frames, "aclose", None)) is not None:
            # Suspended at a yield: closing runs its cleanup now, in this task.
            await aclose()


async def _next_frame(frames: AsyncIterator[bytes], scope: anyio.CancelScope) -> bytes | None:
    """The source's next frame; None if the scope was cancelled first."""
    with scope:
        return await anext(frames)
    return None


def _retrieve(future: asyncio.Future[Any]) -> None:
    # The outcome of a frame nobody waits for any more (the stream is over):
    # retrieved, so that asyncio does not log it as never retrieved.
    with contextlib.suppress(BaseException):
        future.result()
