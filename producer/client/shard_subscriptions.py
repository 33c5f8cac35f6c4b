"""The async client's subscriptions on a Redis Cluster: shard channels, on their nodes.

A job's channels are shard channels there (``Keys.sharded``): their messages
stay on the shard that owns the channel's slot instead of crossing the cluster
bus to every node, and a reader subscribes on that shard. So one multiplexed
connection per node (``Subscriptions``, speaking SSUBSCRIBE), made when a
channel of the node is first listened to.

A channel leaves its node with a failover or a resharding (the node
unsubscribes it, or is lost, or answers MOVED): the node's object reads the
slot map again and its listeners find ``MOVED`` on their queue; they listen
again here, on the node that serves the channel now, and re-read the job's log
from their cursor, so no event is lost or doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from redis.exceptions import RedisClusterException, RedisError

from tokenfleet.shared.compat.redis_py import refresh_slot_map_async
from tokenfleet.shared.redis.cluster import AsyncCluster
from tokenfleet.shared.redis.connect import ready
from tokenfleet.client.subscriptions import Subscriptions


class ShardedSubscriptions:
    """``Subscriptions``' interface, for a cluster's client; owned by one event loop."""

    def __init__(self, cluster: AsyncCluster) -> None:
        self._cluster = cluster
        self._nodes: dict[str, Subscriptions] = {}  # by node name

    @contextlib.asynccontextmanager
    async def listen(self, channel: str) -> AsyncIterator[asyncio.Queue[bytes]]:
        """As ``Subscriptions.listen``; the queue may also hold ``MOVED``."""
        await ready(self._cluster)  # the slot map, read once
        name, client = self._cluster.owner_client(channel)
        node = self._nodes.get(name)
        if node is None:
            node = self._nodes[name] = Subscriptions(client, moved=self._reread)
        async with node.listen(channel) as queue:
            yield queue

    async def _reread(self) -> None:
        """Read the slot map again; a map no node gave (all down) is read on a
        later move."""
        with contextlib.suppress(RedisError, RedisClusterException, OSError):
            await refresh_slot_map_async(self._cluster)

    async def close(self) -> None:
        for node in self._nodes.values():
            await node.close()
