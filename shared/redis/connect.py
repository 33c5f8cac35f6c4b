"""Redis clients that ride out a restart or a dropped connection, and fail fast
when there was never a connection to ride out (the rule: ``redis_retry``).

Callers with loops of their own (the feeder, subscribers) also back off.
``rediss://`` and ``user:password@`` URLs work as redis-py parses them;
``redis+cluster://host:port`` (``rediss+cluster://`` with TLS), any node, gives
a Redis Cluster client instead (``redis_cluster``).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.exceptions import ConnectionError, TimeoutError

from tokenfleet.shared.redis.cluster import (AsyncCluster, connect_cluster, left_node,
                                             resubscribe_after)
from tokenfleet.shared.redis.pool import BoundedPool, PoolBound
from tokenfleet.shared.redis.retry import AsyncFailFastRetry, FailFast, FailFastRetry
from tokenfleet.shared.redis.url import is_cluster, node_url, redacted

__all__ = ["broker_url", "connect", "connect_async", "is_cluster", "left_node", "node_client",
           "node_url", "ready", "redacted", "resubscribe_after"]

# Each live stream()/wait() holds a pub/sub connection of its own: a web backend
# following hundreds of jobs needs more than redis-py's default of 100.
MAX_CONNECTIONS = 2000
# How long one TCP connect may take: also the bound on a first connect that fails.
CONNECT_TIMEOUT_S = 3.0
# An asyncio client's connections, unless it is given a bound: its commands
# are short and its event streams share one pub/sub connection, so a hundred
# serve thousands of concurrent calls. A burst that opened thousands at once
# would see connects that a busy event loop cannot finish in CONNECT_TIMEOUT_S.
ASYNC_CONNECTIONS = 100
# How long a command waits for a free connection once all are in use (a burst
# of thousands of concurrent submits from one client): it waits its turn
# instead of failing at once, and fails only past this.
CONNECTION_WAIT_S = 30.0


def _options() -> dict[str, Any]:
    return {
        "decode_responses": False,
        "health_check_interval": 30,
        "socket_keepalive": True,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        # A half-open connection (a peer gone without a FIN) fails instead of
        # hanging a thread forever; far above any BLOCK the fleet uses.
        "socket_timeout": 60,
        "retry_on_error": [ConnectionError, TimeoutError, ConnectionResetError],
        "max_connections": MAX_CONNECTIONS,
    }


def connect(url: str) -> redis.Redis:
    """A client of the Redis ``url`` names; it connects on its first command.
    Past ``MAX_CONNECTIONS`` in use at once (threads), a command waits up to
    ``CONNECTION_WAIT_S`` for a free one (redis-py's plain pool would raise)."""
    if is_cluster(url):
        # Typed as a plain client: RedisCluster answers every command the fleet sends.
        return connect_cluster(url, _options())  # type: ignore[return-value]
    # As Redis.from_url builds it, with the pool that waits.
    pool = redis.BlockingConnectionPool.from_url(
        url, timeout=CONNECTION_WAIT_S, retry=FailFastRetry(FailFast(url)), **_options())
    client = redis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True
    return client


def connect_async(url: str, bound: PoolBound | None = None) -> aioredis.Redis:
    """:func:`connect` for asyncio. Its connections come from a ``BoundedPool``:
    at most ``bound.connections`` (None: ``ASYNC_CONNECTIONS``, waiting up to
    ``CONNECTION_WAIT_S``), a command waiting for a free one (``RedisBusy``
    past the wait: redis-py's own pool raises ``MaxConnectionsError`` at once,
    and a burst of submits failed by the thousand), idle ones closed; on a
    cluster, at most that many per node (a command that finds none free gets
    redis-py's ``MaxConnectionsError``, which the cluster client's retry backs
    off from as from a lost connection)."""
    if is_cluster(url):
        options = _options() if bound is None else {**_options(),
                                                    "max_connections": bound.connections}
        # Typed as a plain client, as in ``connect``.
        return AsyncCluster.for_url(url, options, connect_async)  # type: ignore[return-value]
    retry = AsyncFailFastRetry(FailFast(url))
    bound = bound or PoolBound(ASYNC_CONNECTIONS, CONNECTION_WAIT_S)
    return aioredis.Redis.from_pool(BoundedPool.for_url(url, bound, {**_options(), "retry": retry}))


def node_client(client: Any, key: str) -> Any:
    """The plain client of the node that holds ``key`` (the client itself when it
    is not a cluster's): for raw connections, which a cluster client has none of."""
    if isinstance(client, redis.cluster.RedisCluster):
        return client.get_node_from_key(key).redis_connection  # type: ignore[no-untyped-call]
    return client


async def ready(client: Any) -> Any:
    """``client`` once it may open a pub/sub: a cluster client reads the slot map first."""
    if isinstance(client, aiocluster.RedisCluster):
        await client.initialize()
    return client


def broker_url(url: str, celery_prefix: str) -> str:
    """Celery's broker: the Redis itself, or on a cluster the node that holds
    Celery's keys (one hash tag: ``Keys.celery_prefix``); Kombu's Redis transport
    speaks to one server, not to a cluster."""
    if not is_cluster(url):
        return url
    client = connect_cluster(url, _options())
    try:
        node = client.get_node_from_key(celery_prefix)  # type: ignore[no-untyped-call]
        return node_url(url, node.host, int(node.port))
    finally:
        client.close()
