"""The cancel listener: cancels of running jobs, heard on pub/sub and applied by the
engine between steps.

A cancel is a publish, heard only by a listener already subscribed: the worker starts
no job before ``listening`` is set. On a Redis Cluster a PUBLISH reaches the
subscribers of every node, and a cancel is published by a script on the node of the
job's queue: the listener subscribes there, on the node this worker needs anyway, not
on the node of the channel's own slot, whose death would deafen it. After a loss the
slot map is read again, so it follows a replica that took its queue's node's place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from tokenfleet.shared.redis.cluster import reread_slot_map
from tokenfleet.shared.redis.connect import node_client
from tokenfleet.shared.wire.keys import Keys

log = logging.getLogger(__name__)

# How long a starting worker waits for its cancel listener before it serves anyway.
LISTENING_WAIT_S = 10.0


class CancelListener:
    def __init__(self, redis: Any, keys: Keys, partition: Callable[[], str],
                 cancel: Callable[[str], None], stopping: threading.Event) -> None:
        self.redis = redis
        self.keys = keys
        self.partition = partition  # the first partition served: read once started
        self.cancel = cancel
        self.stopping = stopping  # set: end
        self.listening = threading.Event()  # set once subscribed

    def wait_listening(self) -> None:
        """Wait until subscribed, warning after ``LISTENING_WAIT_S`` (the worker
        then serves anyway)."""
        if not self.listening.wait(LISTENING_WAIT_S):
            log.warning("the cancel listener is not subscribed after %.0f s; serving anyway "
                        "(a cancel of a running job may go unheard until it is)",
                        LISTENING_WAIT_S)

    def run(self) -> None:
        queue_key = self.keys.queue(self.partition())
        while not self.stopping.is_set():
            pubsub = node_client(self.redis, queue_key).pubsub()
            try:
                pubsub.subscribe(self.keys.cancels)
                while not self.stopping.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        # From this reply on, every cancel reaches this listener.
                        self.listening.set()
                    elif message["type"] == "message":
                        self.cancel(message["data"].decode())
            except (RedisError, OSError) as exc:
                log.warning("cancel listener lost redis (%s); resubscribing", exc)
                self.stopping.wait(0.5)
                reread_slot_map(self.redis)
            finally:
                pubsub.close()
