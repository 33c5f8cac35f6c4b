"""Shims over what redis-py does not document, each tested in ``tests/test_compat_redis.py``.

- A hook around every command of a cluster client: its ``retry`` sets only how
  many times its own loop tries a command, with no pause between the tries, so
  a failover (seconds) outlasts them; the hook lets the fleet's retry, with its
  backoff, run that whole loop again.
- Reading a cluster's slot map again: redis-py does it on its own only after a
  command met an error, not when a pub/sub lost its node.
- Telling apart, by its text, the error of an asyncio connection another task
  closed before a command was written on it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio.cluster as aiocluster
import redis.cluster


class HookedCluster(redis.cluster.RedisCluster):
    """redis-py's cluster client; each command it sends (a command method, a
    script, a publish) runs as ``around_command(send)``, where ``send`` runs
    redis-py's own loop once."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        once = super().execute_command
        return self.around_command(lambda: once(*args, **kwargs))  # type: ignore[no-untyped-call]

    def around_command(self, send: Callable[[], Any]) -> Any:
        return send()


class AsyncHookedCluster(aiocluster.RedisCluster):
    """:class:`HookedCluster` for redis-py's asyncio cluster client."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        once = super().execute_command
        return await self.around_command(lambda: once(*args, **kwargs))

    async def around_command(self, send: Callable[[], Awaitable[Any]]) -> Any:
        return await send()


def refresh_slot_map(client: redis.cluster.RedisCluster) -> None:
    """Read the cluster's slot map again from any node that answers."""
    client.nodes_manager.initialize()


async def refresh_slot_map_async(client: aiocluster.RedisCluster) -> None:
    """:func:`refresh_slot_map` for an asyncio cluster client."""
    await client.nodes_manager.initialize()


# What redis-py's asyncio connection raises when a command is written on a
# connection another task closed under it (the cluster client closes a node's
# idle connections while they stay on its free list, after a connection error
# on that node): no writer any more, or a closed transport.
_CLOSED_UNDER_WRITE = ("object has no attribute 'writelines'", "the handler is closed")


def closed_under_write(error: Exception) -> bool:
    """Whether ``error`` (an AttributeError or RuntimeError out of a command)
    says the connection was closed before the command was written: nothing
    reached Redis, and redis-py dropped the connection, so it can go again."""
    return isinstance(error, AttributeError | RuntimeError) and any(
        text in str(error) for text in _CLOSED_UNDER_WRITE)
