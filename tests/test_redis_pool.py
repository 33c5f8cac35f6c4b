"""The gateway's connection pool on a real redis-server: a bound that commands wait
for, ``RedisBusy`` when none comes free in time, and idle connections closed."""

from __future__ import annotations

import asyncio
import pytest
import redis
import redis.asyncio as aioredis

from tokenfleet.shared.wire.errors import RedisBusy
from tokenfleet.shared.redis.pool import BoundedPool, PoolBound

from helpers import wait_until

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.single_redis("counts the connections of one redis-server")]


def pooled(url: str, name: str, bound: PoolBound) -> aioredis.Redis:
    """A client on a ``BoundedPool`` whose connections show in CLIENT LIST as ``name``."""
    return aioredis.Redis.from_pool(BoundedPool.for_url(url, bound, {"client_name": name}))


def open_named(r: redis.Redis, name: str) -> int:
    return sum(client["name"] == name for client in r.client_list())


async def test_a_command_waits_for_a_connection_handed_back_and_runs_on_it(
    redis_url: str, r: redis.Redis, namespace: str
) -> None:
    client = pooled(redis_url, namespace, PoolBound(connections=1, wait_s=30))
    held = await client.connection_pool.get_connection()
    ping = asyncio.ensure_future(client.ping())
    await client.connection_pool.release(held)
    assert await asyncio.wait_for(ping, 10) is True
    assert await asyncio.to_thread(open_named, r, namespace) == 1  # the same one, not a second
    await client.aclose()


async def test_a_command_that_finds_no_connection_free_in_time_says_the_fleet_is_busy(
    redis_url: str, namespace: str
) -> None:
    client = pooled(redis_url, namespace, PoolBound(connections=2, wait_s=0.2))
    held = [await client.connection_pool.get_connection() for _ in range(2)]
    with pytest.raises(RedisBusy) as refused:
        await client.ping()
    message = str(refused.value)
    assert "busy" in message and "2 Redis connections" in message
    assert "TOKENFLEET_GATEWAY_REDIS_CONNECTIONS" in message
    for connection in held:
        await client.connection_pool.release(connection)
    assert await client.ping() is True  # and the pool serves once they are back
    await client.aclose()


async def test_a_waiter_that_gives_up_leaves_its_turn_to_the_next(
    redis_url: str, namespace: str
) -> None:
    client = pooled(redis_url, namespace, PoolBound(connections=1, wait_s=30))
    pool = client.connection_pool
    held = await pool.get_connection()
    first = asyncio.ensure_future(client.ping())
    second = asyncio.ensure_future(client.ping())
    while pool.waiting < 2:  # both in line
        await asyncio.sleep(0)
    await pool.release(held)  # handed to the first in line...
    first.cancel()  # ...whose client hung up before it took it
    assert await asyncio.wait_for(second, 10) is True
    with pytest.raises(asyncio.CancelledError):
        await first
    await client.aclose()


async def test_connections_idle_past_the_idle_time_close_and_reopen_on_demand(
    redis_url: str, r: redis.Redis, namespace: str
) -> None:
    client = pooled(redis_url, namespace, PoolBound(connections=8, wait_s=5, idle_s=0.3))
    # Eight commands at once: eight connections, each opened for one of them.
    held = [await client.connection_pool.get_connection() for _ in range(8)]
    for connection in held:
        await client.connection_pool.release(connection)
    assert await asyncio.to_thread(open_named, r, namespace) == 8
    await asyncio.to_thread(wait_until, lambda: open_named(r, namespace) == 0, 10,
                            "the idle connections to close")
    assert await client.ping() is True
    assert await asyncio.to_thread(open_named, r, namespace) == 1
    await client.aclose()


def test_every_pool_option_reaches_its_connections(redis_url: str) -> None:
    pool = BoundedPool.for_url(redis_url, PoolBound(connections=3, wait_s=1.5),
                               {"socket_timeout": 60})
    assert (pool.max_connections, pool.wait_s) == (3, 1.5)
    assert pool.connection_kwargs["socket_timeout"] == 60
