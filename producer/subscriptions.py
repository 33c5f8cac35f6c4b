"""One pub/sub connection for every live ``stream()`` and ``wait()`` of an async client.

A web backend following a thousand jobs holds one subscriber connection, not a
thousand: a reader task takes every message off the shared connection and puts
it on the queues of that channel's listeners. Messages published while the
connection was down are lost, as with any pub/sub; listeners re-read the job's
log when they hear nothing for a while, so nothing reaches them out of order or
not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from redis.exceptions import ConnectionError, TimeoutError

log = logging.getLogger(__name__)


class Subscriptions:
    def __init__(self, redis: Any) -> None:
        self._redis = redis
        self._pubsub: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._listeners: dict[bytes, set[asyncio.Queue[bytes]]] = {}
        self._confirmed: dict[bytes, asyncio.Event] = {}
        # redis-py's PubSub opens its connection on the first command: two first
        # commands at once would open two, and only one of them is read.
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def listen(self, channel: str) -> AsyncIterator[asyncio.Queue[bytes]]:
        """A queue of the channel's messages, subscribed (and confirmed) on entry."""
        name = channel.encode()
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        listeners = self._listeners.setdefault(name, set())
        listeners.add(queue)
        try:
            if len(listeners) == 1:
                self._confirmed[name] = asyncio.Event()
                async with self._lock:
                    if self._pubsub is None:
                        self._pubsub = self._redis.pubsub()
                    await self._pubsub.subscribe(name)
            self._ensure_reader()
            # Only after the server confirms is every later publish seen, so a
            # read of the job's log after this point cannot miss a token.
            await asyncio.wait_for(self._confirmed[name].wait(), timeout=10)
            yield queue
        finally:
            listeners.discard(queue)
            if not listeners:
                self._listeners.pop(name, None)
                self._confirmed.pop(name, None)
                with contextlib.suppress(ConnectionError, TimeoutError, OSError):
                    async with self._lock:
                        await self._pubsub.unsubscribe(name)

    def _ensure_reader(self) -> None:
        # Started after the first subscribe: reading needs the connection it opens.
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        backoff = 0.05
        while True:
            try:
                message = await self._pubsub.get_message(timeout=1.0)
                backoff = 0.05
            except (ConnectionError, TimeoutError, OSError) as exc:
                log.warning("pub/sub connection lost (%s); reconnecting", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if message is None:
                continue
            channel = message["channel"]
            if message["type"] == "subscribe":
                event = self._confirmed.get(channel)
                if event is not None:
                    event.set()
            elif message["type"] == "message":
                for queue in self._listeners.get(channel, ()):
                    queue.put_nowait(message["data"])

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
