"""Redis Cluster clients that ride out a failover as the plain clients ride out a restart.

redis-py's cluster client retries a command that met a connection error at
once, reading the slot map again each time: a master that died is still in the
map until its replica is promoted (the cluster's node timeout and an election
later, a second or more), so all its tries go to the dead node and the command
fails. Here that whole loop is retried with the fleet's retry (``redis_retry``),
with the slot map read again between tries, so a failover is ridden out as a
restart is, and a master that died without a replica stops only the queues
whose slots it held. The clients offer the commands,
scripts, pipelines and pub/sub the fleet uses; the keys of each script share a
slot (``keys.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, cast

import redis.asyncio as aioredis
import redis.cluster
from redis.exceptions import (ClusterDownError, ConnectionError, MasterDownError,
                              RedisClusterException, RedisError, TimeoutError, TryAgainError)

from tokenfleet.shared.compat.redis_py import (AsyncHookedCluster, HookedCluster,
                                               closed_under_write, refresh_slot_map,
                                               refresh_slot_map_async)
from tokenfleet.shared.redis.retry import (RETRIES, AsyncFailFastRetry, FailFast, FailFastRetry,
                                           backoff)
from tokenfleet.shared.redis.url import node_url

# A cluster not serving the slot yet, which ran nothing: its nodes coming back
# from a restart, a replica being promoted. redis-py's own loop tries these a few
# times in a fraction of a second; a restart takes seconds.
_NOT_SERVED = (ClusterDownError, TryAgainError, MasterDownError)


def node_error(error: Exception) -> Exception:
    """The error of the node under redis-py's "Redis Cluster cannot be connected":
    its cluster client reads the slot map again after a connection error, and
    reports no node answering (every node restarting, a wrong password) as a
    RedisClusterException whose cause is the last node's error. Raised as that
    error, it is what a single Redis's client meets in the same case: retried
    with backoff (a connection error once the client has been up, so a restart
    of the whole cluster is ridden out), or refused at once (a wrong password,
    a first connect that failed: ``FailFast``)."""
    if isinstance(error, _NOT_SERVED):
        return ConnectionError(f"{type(error).__name__}: {error}")
    cause = error.__cause__
    if isinstance(cause, ConnectionError | TimeoutError):  # AuthenticationError included
        return type(cause)(*cause.args)
    return error


def cluster_error(rule: FailFast, error: Exception) -> Exception:
    """As ``node_error``, outside the retry loop (a client being made, a slot map
    read for a pub/sub), and as ``FailFast`` explains it: a backend that catches
    ``RedisAuthFailed`` or ``RedisUnavailable`` catches them on a cluster too."""
    node = node_error(error)
    return rule.final(node) or node


class Cluster(HookedCluster):
    """redis-py's cluster client, whose commands ride out a failover."""

    def around_command(self, send: Callable[[], Any]) -> Any:
        def node_errors() -> Any:
            try:
                return send()
            except (RedisClusterException, *_NOT_SERVED) as error:
                raise node_error(error) from error

        return self.retry.call_with_retry(node_errors, self._reread_slot_map)

    def _reread_slot_map(self, error: Exception, *failures: int) -> None:
        """After a failed try: the cluster client dropped the connection, and the
        slot map is read again, so the next try goes to the node that holds the
        slot now (a promoted replica). redis-py reads it after most failures of
        its own, not after one raised before its loop (a node it asked about a
        command's keys). Not after an error that is not retried (a refused
        password): every node would refuse the read the same way."""
        rule = getattr(self.retry, "rule", None)
        if isinstance(rule, FailFast) and rule.final(error) is not None:
            return
        reread_slot_map(self)


class ChannelMoved(ConnectionError):
    """A shard channel's slot is served by another node now (a failover, a
    resharding): the node unsubscribed its subscribers (or answered MOVED).
    A connection error, so a reader rides it out as a lost node: it reads the
    slot map again, subscribes where the channel lives, and catches up from
    the job's log."""


def reread_slot_map(client: Any) -> None:
    """On a cluster client, read the slot map again from a node that answers;
    on one Redis, nothing. A map no node gave (all down) is read on a later try."""
    if isinstance(client, redis.cluster.RedisCluster):
        # No node answering is a RedisClusterException, which is no RedisError.
        with contextlib.suppress(RedisError, RedisClusterException, OSError):
            refresh_slot_map(client)


def connect_cluster(url: str, options: dict[str, Any]) -> Cluster:
    rule = FailFast(url)
    try:  # it reads the slot map at once
        client = Cluster.from_url(node_url(url), retry=FailFastRetry(rule), **options)
    except RedisClusterException as error:
        raise cluster_error(rule, error) from error
    rule.succeeded()  # a node answered: from now on a lost connection is ridden out
    return cast(Cluster, client)


def resubscribe_after(client: Any, failures: int) -> bool:
    """Whether a pub/sub whose connection failed for good (redis-py's retries
    spent) should be made again, after a pause: on a cluster, yes, up to
    ``RETRIES`` times, with the slot map read again, since a replica may have
    taken the channel's node's place; on one Redis, no: it is down.
    """
    if not isinstance(client, redis.cluster.RedisCluster) or failures > RETRIES:
        return False
    _pause(backoff().compute(failures))
    reread_slot_map(client)
    return True


def _pause(seconds: float) -> None:
    import time

    time.sleep(seconds)  # the backoff between two tries of a lost node


class AsyncCluster(AsyncHookedCluster):
    """redis-py's asyncio cluster client, whose commands ride out a failover, and
    whose pub/sub goes through a plain client of one node (a PUBLISH reaches the
    subscribers of every node).

    Its own pub/sub would borrow a connection of a node's command pool and hand
    it back disconnected when it closes, failing the commands that use it next
    (no writer, handler closed) while streams open and close by the hundred;
    so subscriptions stay off the command pools, and the rest of those
    failures are ridden out in ``around_command`` (docs/capacity.md, "Redis
    Cluster").
    """

    url: str  # the cluster URL, for the nodes' plain URLs
    plain_clients: dict[str, aioredis.Redis]  # by node name
    plain_client: Callable[[str], aioredis.Redis]  # makes one, given a node's URL
    lost: set[str]  # nodes a pub/sub lost its connection to: passed over by pubsub()

    @classmethod
    def for_url(cls, url: str, options: dict[str, Any],
                plain_client: Callable[[str], aioredis.Redis]) -> AsyncCluster:
        """A client of the cluster ``url`` names; it reads the slot map on its
        first command (or ``ready``)."""
        retry = AsyncFailFastRetry(FailFast(url))
        client = cast(AsyncCluster, cls.from_url(node_url(url), retry=retry, **options))
        client.url, client.plain_client = url, plain_client
        client.plain_clients, client.lost = {}, set()
        return client

    async def around_command(self, send: Callable[[], Awaitable[Any]]) -> Any:
        """A failover is ridden out as a restart is. And a caller cancelled
        mid-command (a stream whose client hung up) does not cancel the command:
        it finishes in a task of its own."""

        async def sent_once() -> Any:
            try:
                return await send()
            except (RedisClusterException, *_NOT_SERVED) as error:
                raise node_error(error) from error
            except (AttributeError, RuntimeError) as error:
                if not closed_under_write(error):
                    raise
                raise ConnectionError(
                    f"the connection closed under the command: {error}") from error

        return await _uncancelled(self.retry.call_with_retry(sent_once, _aignore))

    async def initialize(self, *args: Any, **kwargs: Any) -> Any:
        rule = self.retry.rule  # type: ignore[attr-defined,unused-ignore]
        try:
            client = await super().initialize(*args, **kwargs)
        except RedisClusterException as error:
            raise cluster_error(rule, error) from error
        # A node answered, as a single Redis's client is up once a connection is
        # made: a stream whose pub/sub read the slot map, then lost Redis before
        # its first command, rides out the restart instead of failing at once.
        rule.succeeded()
        return client

    def pubsub(self, node: Any = None, host: Any = None, port: Any = None, **kwargs: Any) -> Any:
        """A pub/sub on a plain connection to a node of our choosing (the
        arguments that would pick one are ignored)."""
        # The slot map is read (see ``ready``); a node just lost may still be in it.
        nodes = [n for n in self.get_nodes() if n.name not in self.lost]
        if not nodes:
            self.lost.clear()
            nodes = self.get_nodes()
        return self._plain(random.choice(nodes)).pubsub(**kwargs)

    def _plain(self, node: Any) -> aioredis.Redis:
        """The plain client of ``node``, made once."""
        plain = self.plain_clients.get(node.name)
        if plain is None:
            plain = self.plain_clients[node.name] = self.plain_client(
                node_url(self.url, node.host, int(node.port)))
        return plain

    def owner_client(self, channel: str) -> tuple[str, aioredis.Redis]:
        """The name and plain client of the node that serves ``channel``'s slot
        in the slot map read last (a shard channel is subscribed there)."""
        node = self.get_node_from_key(channel)
        if node is None:
            raise ConnectionError(f"no node serves the slot of {channel!r}")
        return node.name, self._plain(node)

    async def aclose(self) -> None:
        for plain in self.plain_clients.values():
            await plain.aclose()
        await super().aclose()


async def _aignore(error: Exception, *failures: int) -> None:
    """A failed try needs nothing undone: the cluster client dropped the
    connection and read the slot map again itself. (The asyncio client sends no
    command whose keys it asks a node for; under a gateway's hang-ups a try
    fails often, and a read of the map per failure would be one too many.)"""


async def _uncancelled(command: Coroutine[Any, Any, Any]) -> Any:
    """Await ``command`` in a task of its own, which the caller's cancel does
    not reach (the caller still stops at once).

    redis-py's asyncio cluster client takes a command's connection off the
    node's free list and puts it back in a ``finally``, also when the command
    was cancelled between its write and its reply. Under the gateway's hang-ups
    that left connections with a reply nobody read or half a command written;
    the next command on them failed or read another's reply, the client
    dropped the node's connections while other commands used them, and those
    failed with AttributeError (no writer): requests answered 500. A command
    that always runs to its end leaves its connection whole."""
    task = asyncio.ensure_future(command)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        # Nobody waits for it any more: its outcome is dropped, not logged as
        # an exception never retrieved.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise


async def left_node(client: Any, pubsub: Any) -> bool:
    """On a cluster client, pass over the node ``pubsub`` was connected to (it may
    be gone for good: a master whose replica took over) and read the slot map
    again; True. On one Redis, False."""
    if not isinstance(client, AsyncCluster):
        return False
    connection = getattr(pubsub, "connection", None)
    if connection is not None:
        client.lost.add(f"{connection.host}:{connection.port}")
    with contextlib.suppress(RedisError, OSError):
        await refresh_slot_map_async(client)
    return True
