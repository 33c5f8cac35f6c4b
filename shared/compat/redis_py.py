"""Shims over what redis-py does not document, each tested in ``tests/test_compat_redis.py``.

- A hook around every command of a cluster client: its ``retry`` sets only how
  many times its own loop tries a command, with no pause between the tries, so
  a failover (seconds) outlasts them; the hook lets the fleet's retry, with its
  backoff, run that whole loop again.
- The keys of a stream read (XREAD, XREADGROUP), found in the command itself
  (the cluster client's ``commands_parser``): redis-py asks its default node
  (``COMMAND GETKEYS``) for the keys of a command whose keys may be anywhere in
  it, outside its retry loop, and never replaces that node when it died, so
  every read, alone or pipelined, failed for as long as the process ran.
- Reading a cluster's slot map again: redis-py does it on its own only after a
  command met an error, not when a pub/sub lost its node.
- Telling apart, by its text, the error of an asyncio connection another task
  closed before a command was written on it.
- SSUBSCRIBE and SUNSUBSCRIBE on an asyncio ``PubSub``: its methods for them
  came with redis-py 8.0; before, the command itself is sent, whose replies the
  ``PubSub`` passes on as they come ('ssubscribe', 'smessage', 'sunsubscribe').
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The client's pipelines share its parser: one place covers both. (It
        # stands in for redis-py's CommandsParser, whose other methods it passes on.)
        self.commands_parser = cast(Any, StreamReadKeys(self.commands_parser))


class StreamReadKeys:
    """A cluster client's command parser, which finds the keys of a stream read
    in the command itself and asks the parser it wraps about any other."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser

    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        keys = stream_read_keys(args)
        return keys if keys is not None else self.parser.get_keys(redis_conn, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


def stream_read_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The stream keys of an XREAD or XREADGROUP command (the first half of what
    follows STREAMS), or None for another command."""
    command = _word(args[0]) if args else ""
    if command not in ("XREAD", "XREADGROUP"):
        return None
    # XREADGROUP GROUP <group> <consumer>: names that could read "STREAMS".
    options = 4 if command == "XREADGROUP" else 1
    words = [_word(a) for a in args[options:]]
    if "STREAMS" not in words:
        return None
    after = list(args[options + words.index("STREAMS") + 1:])
    return after[:len(after) // 2]


def _word(arg: Any) -> str:
    if isinstance(arg, bytes):
        return arg.decode("latin-1").upper()
    return str(arg).upper()


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


async def shard_pubsub_command(pubsub: Any, verb: str, *channels: bytes) -> None:
    """``verb`` ('ssubscribe' or 'sunsubscribe') ``channels`` on an asyncio
    ``PubSub``, with redis-py's method where it has one (from 8.0)."""
    method = getattr(pubsub, verb, None)
    if method is not None:
        await method(*channels)
        return
    # As redis-py's execute_command, but with no health check before: the
    # PubSub, knowing no shard channel, takes the connection for an idle one
    # and would read the PING's reply off it, where messages may come first.
    await pubsub.connect()
    connection = pubsub.connection
    await pubsub._execute(connection, connection.send_command, verb.upper(), *channels,
                          check_health=False)


# What redis-py's asyncio connection raises when a command is written on a
# connection another task closed under it (the cluster client closes a node's
# idle connections while they stay on its free list, after a connection error
# on that node): no writer any more, or a closed transport. redis-py 8.2 and
# newer check first and raise a ConnectionError of their own, which every
# retry of the fleet already takes as one.
_CLOSED_UNDER_WRITE = ("object has no attribute 'writelines'", "the handler is closed",
                       "closed by the server before write")


def closed_under_write(error: Exception) -> bool:
    """Whether ``error`` (an AttributeError, RuntimeError or, on newer redis-py,
    ConnectionError out of a command)
    says the connection was closed before the command was written: nothing
    reached Redis, and redis-py dropped the connection, so it can go again."""
    return isinstance(error, AttributeError | RuntimeError | redis.exceptions.ConnectionError) and any(
        text in str(error) for text in _CLOSED_UNDER_WRITE)
