"""Pub/sub connections a blocking client keeps between its ``wait()`` and ``stream()`` calls.

redis-py's ``PubSub.close()`` disconnects, so a client that made a new one per
call opened a TCP connection (a TLS handshake on ``rediss://``) and sent HELLO
for every job it waited for. Here a call that ends leaves its connection,
unsubscribed, for the next one. A Redis error closes it, and every idle one
with it: on a cluster they all lead to the node of the same queue, which may
be the one that died. So does a consumer that leaves a stream part-read (its
generator is closed, maybe by the garbage collector: no network I/O there).

A connection goes back only once Redis confirmed the UNSUBSCRIBE: till then
redis-py still lists the channel, and would subscribe to it again if the kept
connection had to reconnect, so a later caller could hear another job's events.
One that reconnects while unsubscribing is closed for the same reason.

On a Redis Cluster the per-job channels are shard channels (``Keys.sharded``):
a call subscribes with SSUBSCRIBE on a connection to the node that owns the
channel's slot, and the connections kept are kept by node.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from redis.exceptions import MovedError, RedisError

from tokenfleet.shared.redis.cluster import ChannelMoved

# Idle connections kept, for as many threads waiting at once; past that a
# finished call closes its own.
KEEP = 16
# How long a new subscription waits for the server's confirmation.
CONFIRM_S = 5.0


class PubSubPool:
    """Safe for any number of threads: each call has a connection to itself
    from ``subscribed`` until it leaves the ``with``."""

    def __init__(self, redis: Any, keep: int = KEEP, sharded: bool = False) -> None:
        """``sharded``: subscribe with SSUBSCRIBE, on the node of the channel's
        slot (``redis`` is a cluster's client)."""
        self._redis = redis
        self._keep = keep
        self._sharded = sharded
        self._idle: dict[str, list[Any]] = {}  # by node ('' off a cluster's shards)
        self._lock = threading.Lock()
        self._pid = os.getpid()  # a forked child must not share its parent's sockets
        self._closed = False

    @contextmanager
    def subscribed(self, channel: str) -> Iterator[Any]:
        """A ``PubSub`` subscribed to ``channel``, confirmed: every message
        published from now on reaches it."""
        node = self._node(channel)
        pubsub = self._take(node)
        try:
            _subscribe(pubsub, channel, self._sharded)
        except BaseException as exc:
            pubsub.close()
            if isinstance(exc, (RedisError, TimeoutError)):
                self.close_idle()
            raise
        try:
            yield pubsub
        except RedisError:
            pubsub.close()
            self.close_idle()
            raise
        except Exception:  # the caller's own (a deadline, no such job): the connection is sound
            self._put_back(pubsub, node)
            raise
        except BaseException:  # a stream left part-read, an interrupt
            pubsub.close()
            raise
        self._put_back(pubsub, node)

    def _node(self, channel: str) -> str:
        """The node whose connections serve ``channel``: '' but for a shard channel."""
        return str(self._redis.get_node_from_key(channel).name) if self._sharded else ""

    def _take(self, node: str) -> Any:
        with self._lock:
            if self._pid != os.getpid():
                self._idle, self._pid = {}, os.getpid()  # the parent's: never touched here
            if idle := self._idle.get(node):
                return idle.pop()
        if self._sharded:
            # A plain client of the node: the cluster client's pub/sub would
            # take the node from the first channel it is given, and keep it.
            return self._redis.get_node(node_name=node).redis_connection.pubsub()
        return self._redis.pubsub()

    def _put_back(self, pubsub: Any, node: str) -> None:
        link = pubsub.connection
        reconnects = _Reconnects()
        if link is not None:
            link.register_connect_callback(reconnects.seen)
        try:
            if self._sharded:
                pubsub.sunsubscribe()
            else:
                pubsub.unsubscribe()
            deadline = time.monotonic() + CONFIRM_S
            while pubsub.subscribed:  # the channel's last messages, then the confirmation
                left = deadline - time.monotonic()
                if left <= 0 or pubsub.connection is not link or reconnects.count:
                    raise TimeoutError("no confirmation of the unsubscribe on its connection")
                pubsub.get_message(timeout=left)
        except (RedisError, TimeoutError):
            pubsub.close()
            return
        finally:
            if link is not None:
                link.deregister_connect_callback(reconnects.seen)
        with self._lock:
            if not self._closed and sum(map(len, self._idle.values())) < self._keep:
                self._idle.setdefault(node, []).append(pubsub)
                return
        pubsub.close()

    def close_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for pubsub in (p for kept in idle.values() for p in kept):
            pubsub.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.close_idle()


class _Reconnects:
    """Counts the connects of one connection: redis-py keeps a connect callback
    as a weak reference to a method, so it needs an object to live on."""

    def __init__(self) -> None:
        self.count = 0

    def seen(self, connection: Any) -> None:
        self.count += 1


def _subscribe(pubsub: Any, channel: str, sharded: bool) -> None:
    (pubsub.ssubscribe if sharded else pubsub.subscribe)(channel)
    confirmed = "ssubscribe" if sharded else "subscribe"
    # Wait for the confirmation: only then is every later publish seen, so a read
    # of the log after this point cannot miss a token published in between.
    while True:
        try:
            message = pubsub.get_message(ignore_subscribe_messages=False, timeout=CONFIRM_S)
        except MovedError as error:  # the slot map this node came from is stale
            raise ChannelMoved(f"{channel}: {error}") from error
        if message is None:
            raise TimeoutError(f"no confirmation of the subscription to {channel}")
        if message["type"] == confirmed:
            return
