"""One pub/sub connection for every live ``stream()`` and ``wait()`` of an async client.

A web backend following a thousand jobs holds one subscriber connection, not a
thousand: a reader task takes every message off the shared connection and puts
it on the queues of that channel's listeners. Messages published while the
connection was down are lost, as with any pub/sub; listeners re-read the job's
log when they hear nothing for a while, so nothing reaches them out of order or
not at all.

Listeners never send SUBSCRIBE or UNSUBSCRIBE themselves. Entering and leaving
only changes the set of wanted channels, without an await, and wakes the
*keeper*: a task of this object's own, the only one that sends those commands,
which brings the connection's subscriptions to that set. So

- a listener cancelled at any point leaves nothing subscribed: Starlette cancels
  a streaming response whose client hung up at every await until it returns,
  and an await in a listener's cleanup would never finish;
- a Redis outage delays the keeper alone: no listener waits for another's
  SUBSCRIBE or UNSUBSCRIBE, and leaving never waits for Redis at all.

On a Redis Cluster the per-job channels are shard channels: one such object
per node (``shard_subscriptions``) subscribes with SSUBSCRIBE to the channels
whose slots that node serves. When a channel leaves its node (the node
unsubscribes it: a failover, a resharding; or the connection to the node is
lost, or connects again, or it answers MOVED), its listeners find ``MOVED`` on
their queue: they listen again, on the node that serves it now, and re-read the
job's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenfleet.shared.compat.redis_py import shard_pubsub_command
from tokenfleet.shared.redis.connect import left_node, ready

log = logging.getLogger(__name__)

# How long a new listener waits for the server to confirm its subscription.
# Past that (Redis is down, or slow) it goes on unconfirmed: the stream re-reads
# the job's log on every quiet interval, so it loses nothing, it only hears late.
CONFIRM_TIMEOUT_S = 5.0
BACKOFF_S = (0.05, 2.0)  # first and longest pause between two tries of the keeper or reader


CLOSE_WAIT_S = 3.0

# Put on a listener's queue when its shard channel left this node: listen
# again (``ShardedSubscriptions.listen`` finds its node now). Never a payload:
# an event is JSON.
MOVED = b"\x00moved"


class Subscriptions:
    """Owned by one event loop: every method and both tasks run on it, no thread."""

    def __init__(self, redis: Any, *,
                 moved: Callable[[], Awaitable[None]] | None = None,
                 on_listen: Callable[[bytes], None] | None = None) -> None:
        """``moved``: this object serves the shard channels of one node (``redis``,
        a plain client of it); called before its listeners are told that a
        channel left it (it reads the cluster's slot map again).

        ``on_listen``: called with a channel once a new listener of it is
        wanted (the keeper woken), before it waits for the server's
        confirmation: a test awaits that point instead of guessing it."""
        self._redis = redis
        self._on_listen = on_listen
        self._sharded = moved is not None
        self._reread = moved
        self._pubsub: Any = None
        # The wanted channels: a queue per listener, and whether the server has
        # confirmed the channel's subscription since the first of them came.
        self._listeners: dict[bytes, set[asyncio.Queue[bytes]]] = {}
        self._confirmed: dict[bytes, asyncio.Event] = {}
        # The keeper's view of the connection: channels it last sent SUBSCRIBE
        # for; of those, the ones the server confirmed; and channels whose last
        # command failed, so that it is unknown whether the server has them.
        self._sent: set[bytes] = set()
        self._live: set[bytes] = set()
        self._unsure: set[bytes] = set()
        # Shard channels that left this node, whose listeners are told so and
        # have yet to leave: no longer subscribed here.
        self._moved: set[bytes] = set()
        self._wake = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._read_from: Any = None  # the pub/sub the reader reads
        self._reconnected: Any = None  # a shard node's pub/sub whose connection connected again
        self._closed = False

    @contextlib.asynccontextmanager
    async def listen(self, channel: str) -> AsyncIterator[asyncio.Queue[bytes]]:
        """A queue of the channel's messages; on entry, the subscription is confirmed
        (or ``CONFIRM_TIMEOUT_S`` has passed)."""
        name = channel.encode()
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        listeners = self._listeners.setdefault(name, set())
        if not listeners or name in self._moved:
            # A listener back for a channel that left: this node serves it
            # again (the slot map says so): subscribed anew.
            self._moved.discard(name)
            self._confirmed[name] = asyncio.Event()
            if name in self._live:  # still subscribed from the listeners before
                self._confirmed[name].set()
        listeners.add(queue)
        confirmed = self._confirmed[name]
        self._changed()
        if self._on_listen is not None:
            self._on_listen(name)
        try:
            # Only after the server confirms is every later publish seen, so a
            # read of the job's log after this point cannot miss a token.
            with contextlib.suppress(TimeoutError):  # the builtin: asyncio.timeout's
                async with asyncio.timeout(CONFIRM_TIMEOUT_S):
                    await confirmed.wait()
            yield queue
        finally:
            # No await from here on: this runs while the caller is being cancelled.
            listeners.discard(queue)
            if not listeners:
                del self._listeners[name], self._confirmed[name]
                self._moved.discard(name)
                self._changed()

    def _changed(self) -> None:
        # A stream left after close() (an async generator finalized at the loop's
        # shutdown) must start no task: nothing would ever stop it.
        if self._closed:
            return
        self._wake.set()
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        backoff = BACKOFF_S[0]
        while not self._closed:
            await self._wake.wait()
            if self._closed:
                return
            self._wake.clear()
            try:
                await self._sync()
                backoff = BACKOFF_S[0]
            except Exception as exc:
                # redis-py has retried already; go on trying, but never block a
                # listener. Nothing ends this task but close(): a keeper that died
                # left the channels it had yet to subscribe on polling, for good
                # once every listener was waiting (none enters or leaves to start
                # another). RuntimeError: redis-py's reconnect inside a
                # (un)subscribe reads the server's greeting while the reader waits
                # on the same connection ("read() called while another coroutine
                # is already waiting"), in an outage. A ResponseError: a cluster
                # still forming after a restart (CLUSTERDOWN).
                expected = isinstance(exc, (RedisError, OSError, RuntimeError))
                log.warning("pub/sub (un)subscribe failed (%s); trying again", exc,
                            exc_info=not expected)
                self._wake.set()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
                if self._sharded:  # the node may be gone: its channels live elsewhere now
                    await self._leave_shard_node()

    async def _sync(self) -> None:
        """Send what makes the server's subscriptions the wanted ones, until they are.

        UNSUBSCRIBE goes first: a channel left and wanted again in between is
        then subscribed by the SUBSCRIBE that follows, in that order on the wire.
        """
        while True:
            wanted = set(self._listeners) - self._moved
            gone = (self._sent | self._unsure) - wanted
            new = wanted - (self._sent - self._unsure)
            self._unsure.clear()
            if not gone and not new:
                return
            if self._pubsub is None:
                self._pubsub = (await ready(self._redis)).pubsub()
            # The reader may leave a shard node while a command below awaits
            # (its connection lost): the sets are cleared then, the channels
            # told they moved, and this connection is done with.
            pubsub = self._pubsub
            if gone:
                self._sent -= gone
                self._live -= gone  # a listener back for one waits for a new confirmation
                try:
                    await self._command(pubsub, "unsubscribe", gone)
                except BaseException:
                    self._unsure |= gone
                    raise
            if new and self._pubsub is pubsub:
                self._sent |= new
                try:
                    await self._command(pubsub, "subscribe", new)
                except BaseException:
                    self._unsure |= new
                    raise
                if self._pubsub is pubsub:
                    self._ensure_reader()

    async def _command(self, pubsub: Any, verb: str, channels: set[bytes]) -> None:
        """(UN)SUBSCRIBE ``channels``; on a node's shard channels S(UN)SUBSCRIBE,
        one command per slot (Redis refuses one that spans slots: CROSSSLOT)."""
        if not self._sharded:
            await getattr(pubsub, verb)(*channels)
            return
        by_slot: dict[int, list[bytes]] = {}
        for channel in channels:
            by_slot.setdefault(key_slot(channel), []).append(channel)
        for same_slot in by_slot.values():
            if self._pubsub is not pubsub:
                return  # left the node meanwhile: these channels moved
            await shard_pubsub_command(pubsub, f"s{verb}", *same_slot)

    def _ensure_reader(self) -> None:
        # Started after the first subscribe: reading needs the connection it opens.
        # One reader per connection: one made after a shard node was left gets
        # its own (the old reader ends by itself).
        if self._reader is None or self._reader.done() or self._read_from is not self._pubsub:
            self._read_from = self._pubsub
            if self._sharded:  # connected now; only a reconnect calls it
                self._pubsub.connection.register_connect_callback(self._seen_reconnect)
            self._reader = asyncio.get_running_loop().create_task(self._read())

    def _seen_reconnect(self, connection: Any) -> None:
        """A shard node's pub/sub connected again, inside redis-py's retry of a
        read or a command: before 8.0 redis-py subscribes none of its shard
        channels again, so they would go quiet; from 8.0 all of them in one
        SSUBSCRIBE, which Redis refuses across slots. The reader makes them move."""
        if self._pubsub is not None and self._pubsub.connection is connection:
            self._reconnected = self._pubsub

    async def _read(self) -> None:
        backoff = BACKOFF_S[0]
        pubsub = self._pubsub
        # Not ``while True``: redis-py turns a cancel that lands inside its read
        # timeout into its own TimeoutError, which this loop rides out; the flag
        # ends it whatever became of the cancel. A connection replaced (a shard
        # node left) has a reader of its own.
        while not self._closed and self._pubsub is pubsub:
            try:
                message = await pubsub.get_message(timeout=1.0)
                backoff = BACKOFF_S[0]
            except (RedisError, RuntimeError, OSError) as exc:
                if self._pubsub is not pubsub:
                    return
                if self._sharded:
                    # Lost, or MOVED (the slot map it was picked from is stale): a
                    # reconnect would subscribe every channel in one command,
                    # which Redis refuses across slots; the listeners move instead.
                    log.warning("shard pub/sub failed (%s); its channels move", exc)
                    await asyncio.sleep(backoff)
                    if self._pubsub is pubsub:
                        await self._leave_shard_node()
                    return
                if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
                    log.warning("pub/sub connection lost (%s); reconnecting", exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, BACKOFF_S[1])
                    if await left_node(self._redis, pubsub):
                        await self._leave_node()
                        return
                    continue
                # A reply that is no message, or a connection closed under the
                # read: the keeper's (un)subscribe reconnected while this read
                # waited on the same connection, and the read got the new
                # connection's greeting ("unknown subcommand 'SETINFO'" from a
                # Redis before 7.2; seen on a cluster under hang-up churn). The
                # reader died of it and every stream fell back to polling. The
                # connection is dropped instead: the next read connects again
                # and subscribes to every channel it had.
                log.warning("pub/sub connection confused (%s); reconnecting", exc)
                with contextlib.suppress(Exception):
                    await pubsub.connection.disconnect()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])
                continue
            if self._reconnected is pubsub:
                log.warning("shard pub/sub reconnected; its channels move")
                await self._leave_shard_node()
                return
            if message is not None and (moved := self._take(message)):
                await self._tell_moved(moved)

    async def _leave_node(self) -> None:
        """On a cluster, the pub/sub's node may be gone for good (a master whose
        replica took over): every wanted channel is subscribed again, on another
        node of the slot map just read, by the keeper, which then starts a reader."""
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()
        # No await from here on: the keeper runs once this reader is done.
        self._pubsub = None
        self._sent.clear()
        self._live.clear()
        self._unsure.clear()
        self._changed()

    async def _leave_shard_node(self) -> None:
        """The node may be gone (a master whose replica took over) or no longer
        serve these slots: every wanted channel is told it moved, and a new
        connection serves the listeners that come back here."""
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
        self._sent.clear()
        self._live.clear()
        self._unsure.clear()
        await self._tell_moved(set(self._listeners) - self._moved)

    async def _tell_moved(self, channels: set[bytes]) -> None:
        """Tell the listeners of ``channels`` that they left this node, once the
        slot map is read again (so they find the node that serves them now)."""
        assert self._reread is not None
        log.info("%d shard channels left their node; their listeners listen again", len(channels))
        await self._reread()
        for channel in channels:
            if channel not in self._listeners:
                continue
            self._moved.add(channel)
            self._confirmed[channel].set()  # a listener waiting to be confirmed goes on
            for queue in self._listeners[channel]:
                queue.put_nowait(MOVED)
        self._changed()

    def _take(self, message: dict[str, Any]) -> set[bytes]:
        """Deliver one message; the channels that left this node (none but for
        an unsubscribe this object did not ask for)."""
        channel = message["channel"]
        kind = message["type"]
        if kind in ("message", "smessage"):
            for queue in self._listeners.get(channel, ()):
                queue.put_nowait(message["data"])
        elif kind == "sunsubscribe" and channel in self._sent:
            # The node dropped it: its slot is another node's now.
            self._sent.discard(channel)
            self._live.discard(channel)
            return {channel}
        elif kind in ("subscribe", "ssubscribe"):
            if channel in self._sent:
                self._live.add(channel)
                event = self._confirmed.get(channel)
                if event is not None:
                    event.set()
            if channel not in self._listeners:
                # Subscribed though nobody wants it: redis-py resubscribes what it
                # had on a reconnect, including a channel whose UNSUBSCRIBE was
                # lost with the old connection. Let the keeper unsubscribe it.
                self._unsure.add(channel)
                self._changed()
        return set()

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        tasks = {t for t in (self._keeper, self._reader) if t is not None and not t.done()}
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a cancel swallowed by a read's timeout is ended by the flag
            # within the read's 1 s.
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
