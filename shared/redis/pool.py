"""An asyncio connection pool with a bound, a wait for a free connection, and
idle connections closed: the gateway's.

redis-py's default pool opens a connection for every command that finds none
free and keeps all of them for good: a spike of a few thousand requests left as
many connections open on Redis, and past the pool's cap the requests failed as
if Redis could not be reached. Here a command waits up to ``wait_s`` for one of
``max_connections`` (the pub/sub connection of the client's event streams counts
too, as it comes from the same pool), then raises ``RedisBusy``; a connection
unused for ``idle_s`` is closed, so the count falls back to what the load needs.

Not redis-py's ``BlockingConnectionPool``: its waiters take turns on one lock,
one turn per pass of the event loop, and a loop busy with a spike's requests
makes a pass last a second or more; waiters timed out by the thousand while
the pool's connections sat free. Here a released connection goes straight to
the longest waiter, with no lock: the pool's state changes only between awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from redis.asyncio import ConnectionPool
from redis.exceptions import MaxConnectionsError, RedisError

from tokenfleet.shared.wire.errors import RedisBusy

# A connection unused this long is closed. Long enough that a steady load keeps
# reusing its connections (the pool hands out the most recently used first), short
# enough that a spike's extra connections are gone within seconds.
IDLE_S = 5.0
# How often idle connections are looked for, while there are any.
SWEEP_S = 1.0


@dataclass(frozen=True)
class PoolBound:
    """How many connections a client may hold, and how long a command waits for one."""

    connections: int
    wait_s: float
    idle_s: float = IDLE_S


class BoundedPool(ConnectionPool):
    """redis-py's pool, capped at ``max_connections``: a command that finds none
    free waits its turn, first come first served, for up to ``wait_s``; a
    connection idle for ``idle_s`` is closed. Owned by one event loop."""

    def __init__(self, *, wait_s: float, idle_s: float = IDLE_S, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wait_s, self.idle_s = wait_s, idle_s
        # Commands waiting for a connection, oldest first; and how many of them
        # were handed one that they have not taken yet (it is kept for them).
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._woken = 0
        # Connections handed back and not taken since, with when (the loop's clock).
        self._idle_since: dict[Any, float] = {}
        self._sweeper: asyncio.Task[None] | None = None
        # For the gateway's metrics: connections handed out and not yet back;
        # commands that had to wait for one, and those that waited in vain.
        self._taken: set[Any] = set()
        self.waits = 0
        self.timeouts = 0

    @classmethod
    def for_url(cls, url: str, bound: PoolBound, options: dict[str, Any]) -> BoundedPool:
        """A pool of connections to the Redis ``url`` names, with redis-py's ``options``."""
        options = {**options, "max_connections": bound.connections}
        return cls.from_url(url, wait_s=bound.wait_s, idle_s=bound.idle_s, **options)

    @property
    def waiting(self) -> int:
        """How many commands wait for a connection now."""
        return len(self._waiting)

    @property
    def in_use(self) -> int:
        """How many connections are handed out now (a pub/sub's included)."""
        return len(self._taken)

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        deadline = asyncio.get_running_loop().time() + self.wait_s
        my_turn = not self._waiting and not self._woken  # nobody was here first
        take = super().get_connection
        while True:
            if my_turn and self.can_get_connection():
                try:
                    connection = await take(*args, **kwargs)  # type: ignore[no-untyped-call]
                except MaxConnectionsError:
                    pass  # taken while redis-py's release held its lock: wait again
                else:
                    self._idle_since.pop(connection, None)
                    self._taken.add(connection)
                    return connection
            await self._wait_turn(deadline)
            my_turn = True

    async def _wait_turn(self, deadline: float) -> None:
        """Until a released connection is handed to this caller; ``RedisBusy`` at ``deadline``."""
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self.waits += 1
        try:
            async with asyncio.timeout_at(deadline):
                await turn
        except BaseException as exc:
            if not turn.done():
                self._waiting.remove(turn)
            elif not turn.cancelled():
                # Handed a connection as the wait ended (a deadline, a client that
                # hung up): it goes to the next in line instead of being lost.
                self._woken -= 1
                self._wake_next()
            if isinstance(exc, TimeoutError):
                self.timeouts += 1
                raise RedisBusy(self.max_connections, self.wait_s) from None
            raise
        self._woken -= 1

    def _wake_next(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                self._woken += 1
                return

    async def release(self, connection: Any) -> None:
        self._taken.discard(connection)
        await super().release(connection)
        self._wake_next()
        if not connection.is_connected:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # released outside the loop (a finalizer): left open
            return
        self._idle_since[connection] = loop.time()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close connections idle for ``idle_s``, until none is left idle."""
        loop = asyncio.get_running_loop()
        while self._idle_since:
            await asyncio.sleep(SWEEP_S)
            now = loop.time()
            # A fresh look at each: the awaits below let commands take and
            # hand back connections meanwhile.
            for connection in list(self._idle_since):
                since = self._idle_since.get(connection)
                if since is None or now - since < self.idle_s:
                    continue
                del self._idle_since[connection]
                # nowait: nothing in the close awaits between its look at the
                # socket and its drop of it, so a command that takes this
                # connection meanwhile finds it closed and connects it again,
                # never half-closed. It stays in the pool, as a slot to reconnect.
                with contextlib.suppress(RedisError, OSError):
                    await connection.disconnect(nowait=True)

    async def disconnect(self, inuse_connections: bool = True) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._idle_since.clear()
        await super().disconnect(inuse_connections)
