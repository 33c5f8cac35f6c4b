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

import pytest

from helpers import RedisServer
from tokenfleet.shared.redis_conn import connect_async
from tokenfleet.subscriptions import MOVED, Subscriptions

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
