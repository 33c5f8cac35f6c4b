"""Pub/sub connections a blocking client keeps between its ``wait()`` and ``stream()`` calls.

redis-py's ``PubSub.close()`` disconnects, so a client that made a new one per
call opened a TCP connection (a TLS handshake on ``rediss://``) and sent HELLO
for every job it waited for. Here a call that ends normally unsubscribes and
leaves its connection for the next one, on any thread, one caller at a time.
A call that ends with an error (or a consumer that leaves a stream part-read)
closes its connection instead.

A connection goes back only once Redis confirmed the UNSUBSCRIBE: till then
redis-py still lists the channel, and would subscribe to it again if the kept
connection had to reconnect, so a later caller could hear another job's events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from redis.exceptions import RedisError

# Idle connections kept; past that a finished call closes its own. A web
# backend's threads rarely wait on more jobs at once than it has threads.
KEEP = 16
# How long a new subscription waits for the server's confirmation.
CONFIRM_S = 5.0


class PubSubPool:
    def __init__(self, redis: Any, keep: int = KEEP) -> None:
        self._redis = redis
        self._keep = keep
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    @contextmanager
    def subscribed(self, channel: str) -> Iterator[Any]:
        """A ``PubSub`` subscribed to ``channel``, confirmed: every message
        published from now on reaches it."""
        with self._lock:
            pubsub = self._idle.pop() if self._idle else self._redis.pubsub()
        try:
            _subscribe(pubsub, channel)
            yield pubsub
        except BaseException:
            pubsub.close()
            raise
        self._put_back(pubsub)

    def _put_back(self, pubsub: Any) -> None:
        try:
            pubsub.unsubscribe()
            deadline = time.monotonic() + CONFIRM_S
            while pubsub.subscribed:  # the channel's last messages, then the confirmation
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no confirmation of the unsubscribe")
                pubsub.get_message(timeout=left)
        except (RedisError, TimeoutError):
            pubsub.close()
            return
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(pubsub)
                return
        pubsub.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for pubsub in idle:
            pubsub.close()


def _subscribe(pubsub: Any, channel: str) -> None:
    pubsub.subscribe(channel)
    # Wait for the confirmation: only then is every later publish seen, so a read
    # of the log after this point cannot miss a token published in between.
    while True:
        message = pubsub.get_message(ignore_subscribe_messages=False, timeout=CONFIRM_S)
        if message is None:
            raise TimeoutError(f"no confirmation of the subscription to {channel}")
        if message["type"] == "subscribe":
            return
