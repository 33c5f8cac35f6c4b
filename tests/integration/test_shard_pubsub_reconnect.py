"""A shard node's pub/sub connection that connects again inside redis-py's
retry (the server closed it; the node lives): its listeners are told that their
channels moved, and listen again. Left alone, redis-py before 8.0 subscribes no
shard channel again on a reconnect, so the channels went quiet; from 8.0 it
subscribes all of them in one SSUBSCRIBE, which Redis refuses across slots.

A single Redis serves shard channels too (SSUBSCRIBE, SPUBLISH): it stands in
for one node of a cluster.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from helpers import RedisServer
from tokenfleet.client import subscriptions as subscriptions_module
from tokenfleet.shared.redis.connect import connect_async
from tokenfleet.client.subscriptions import MOVED, Subscriptions

pytestmark = pytest.mark.timeout(60)


async def test_a_shard_pubsub_that_reconnects_moves_its_channels(
        redis_server: RedisServer) -> None:
    client = connect_async(redis_server.url)
    rereads: list[bool] = []

    async def reread() -> None:  # the slot map, read again
        rereads.append(True)

    subscriptions = Subscriptions(client, moved=reread)
    try:
        async with (subscriptions.listen("reconnect:{a}") as first,
                    subscriptions.listen("reconnect:{b}") as second):
            await client.spublish("reconnect:{a}", b"before")
            assert await asyncio.wait_for(first.get(), 10) == b"before"
            await client.client_kill_filter(_type="pubsub")
            assert await asyncio.wait_for(first.get(), 30) == MOVED
            assert await asyncio.wait_for(second.get(), 30) == MOVED
            assert rereads
        # Back on this node: a new connection, subscribed again.
        async with subscriptions.listen("reconnect:{a}") as again:
            await client.spublish("reconnect:{a}", b"after")
            assert await asyncio.wait_for(again.get(), 10) == b"after"
    finally:
        await subscriptions.close()
        await client.aclose()


async def test_a_node_left_while_a_subscribe_awaits_subscribes_its_listeners_again(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's connection is lost while the keeper's SSUBSCRIBE of another
    channel awaits (a whole cluster restarting): the reader leaves the node and
    its listeners listen again before that SSUBSCRIBE returns. The keeper goes
    on with a new connection; it died there once, and the listeners that came
    back were never subscribed again."""
    client = connect_async(redis_server.url)
    held, hold = asyncio.Event(), asyncio.Event()
    send = subscriptions_module.shard_pubsub_command

    async def held_send(pubsub: Any, verb: str, *channels: bytes) -> None:
        await send(pubsub, verb, *channels)
        if verb == "ssubscribe" and channels == (b"race:{b}",) and not held.is_set():
            held.set()
            await hold.wait()

    monkeypatch.setattr(subscriptions_module, "shard_pubsub_command", held_send)

    async def reread() -> None:
        pass

    listening: dict[bytes, int] = {}
    heard_again = asyncio.Event()

    def on_listen(channel: bytes) -> None:
        listening[channel] = listening.get(channel, 0) + 1
        if channel == b"race:{a}" and listening[channel] == 2:
            heard_again.set()

    subscriptions = Subscriptions(client, moved=reread, on_listen=on_listen)

    async def follow_b() -> bytes:
        async with subscriptions.listen("race:{b}") as b:
            return await b.get()

    try:
        async with subscriptions.listen("race:{a}") as a:
            b_told = asyncio.ensure_future(follow_b())
            await asyncio.wait_for(held.wait(), 10)
            await client.client_kill_filter(_type="pubsub")
            assert await asyncio.wait_for(a.get(), 30) == MOVED
        assert await asyncio.wait_for(b_told, 30) == MOVED

        async def follow_a_again() -> bytes:
            async with subscriptions.listen("race:{a}") as again:
                await client.spublish("race:{a}", b"after")
                return await asyncio.wait_for(again.get(), 10)

        again = asyncio.ensure_future(follow_a_again())
        # It listens (waits for its confirmation) before the held send returns.
        await asyncio.wait_for(heard_again.wait(), 10)
        hold.set()
        assert await asyncio.wait_for(again, 30) == b"after"
    finally:
        await subscriptions.close()
        await client.aclose()
