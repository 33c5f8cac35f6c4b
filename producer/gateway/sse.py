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

    The source runs in one task of its own for the whole stream and hands its
    frames over through a buffer, so a keep-alive never cancels it half-way, and
    a frame costs a hand-over: not a task, a cancel scope, a wait and a timeout
    each (they were a fifth of a busy gateway's CPU). Frames that piled up while the
    client's socket was slow go out as one write. That task is outside the
    cancel scope of the request: when the request ends (its client hung up, or
    the response is complete) it is cancelled here, through a cancel scope of its
    own. A scope, not ``Task.cancel()``: Python 3.11's ``asyncio.wait_for`` loses a
    cancel that comes as the awaited future completes (the source would then run
    on for good, its subscription with it), and a scope cancels again at every
    await until the task has left it; it also leaves the source's shielded
    cleanup alone.
    """
    frames = _Frames(interval)
    scope = anyio.CancelScope()
    pump = asyncio.ensure_future(_pump(source, frames, scope))
    pump.add_done_callback(frames.ended)
    try:
        while True:
            await frames.arrived()
            ready, end = frames.take()
            if ready:
                yield ready
            if end is not None:
                end.reraise()
                return
    finally:
        frames.close()
        scope.cancel()
        pump.add_done_callback(_retrieve)


class _End:
    """The source is over: exhausted, or failed with ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def reraise(self) -> None:
        if self.error is not None:
            raise self.error


class _Frames:
    """Frames from the source's task to the response's, in order, then an ``_End``;
    and the keep-alive clock: one timer for the whole stream that wakes the
    response when ``interval`` s passed since it last sent something, rather
    than a timeout armed and cancelled around every wait for a frame."""

    def __init__(self, interval: float) -> None:
        self.items: list[bytes] = []
        self.end: _End | None = None
        self._quiet = False
        self._arrived = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._interval = interval
        self._sent_at = self._loop.time()
        self._timer = self._loop.call_at(self._sent_at + interval, self._tick)

    def put(self, item: bytes | _End) -> None:
        if isinstance(item, _End):
            self.end = item
        else:
            self.items.append(item)
        self._arrived.set()

    def ended(self, pump: asyncio.Future[None]) -> None:
        """The source's task is done: an end must be in, or the response would
        wait for good (a cancel from elsewhere, at the loop's shutdown)."""
        if self.end is None:
            self.put(_End(RuntimeError("the stream's source stopped without an end")))

    async def arrived(self) -> None:
        """Until a frame or the end is in, or it is time for a keep-alive.
        Waiting takes nothing out: a keep-alive loses no frame."""
        self._arrived.clear()
        if not self.items and self.end is None and not self._quiet:
            await self._arrived.wait()

    def take(self) -> tuple[bytes, _End | None]:
        """What to send now (every frame in, as one; else a keep-alive if it is
        time; else nothing), and the end if it came after those frames."""
        ready, self.items = b"".join(self.items), []
        if not ready and self._quiet:
            ready = KEEPALIVE
        if ready:
            self._quiet = False
            self._sent_at = self._loop.time()
        return ready, self.end

    def close(self) -> None:
        self._timer.cancel()

    def _tick(self) -> None:
        due = self._sent_at + self._interval
        if self._loop.time() >= due:
            self._quiet = True
            self._arrived.set()
            due = self._loop.time() + self._interval
        self._timer = self._loop.call_at(due, self._tick)


async def _pump(source: AsyncIterable[bytes], frames: _Frames, scope: anyio.CancelScope) -> None:
    """``source``'s frames into ``frames``, then an ``_End``; until ``scope`` is cancelled."""
    with scope:
        try:
            async with _closing(source) as items:
                async for frame in items:
                    frames.put(frame)
        except Exception as error:
            frames.put(_End(error))
        else:
            frames.put(_End())


@contextlib.asynccontextmanager
async def _closing(source: AsyncIterable[bytes]) -> AsyncIterator[AsyncIterable[bytes]]:
    """``source``, closed on the way out: a generator left at a yield (the stream was
    cancelled between two frames) runs its cleanup, its subscription's with it."""
    try:
        yield source
    finally:
        if (aclose := getattr(source, "aclose", None)) is not None:
            await aclose()


def _retrieve(future: asyncio.Future[Any]) -> None:
    # The outcome of a stream's source nobody waits for any more (the stream is
    # over): retrieved, so that asyncio does not log it as never retrieved.
    with contextlib.suppress(BaseException):
        future.result()
