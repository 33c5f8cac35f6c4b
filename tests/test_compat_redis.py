"""Each shim of ``tokenfleet.shared.compat.redis_py`` still reaches what it reaches
into on the installed redis-py: a release that moves it fails here first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from helpers import RedisClusterServers, RedisServer
from tokenfleet.shared.compat.redis_py import (AsyncHookedCluster, HookedCluster,
                                               closed_under_write, refresh_slot_map,
                                               refresh_slot_map_async, shard_pubsub_command,
                                               stream_read_keys)
from tokenfleet.shared.redis.url import node_url

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(masters=3)
    yield servers
    servers.close()


def test_every_command_of_a_cluster_client_passes_the_hook(cluster: RedisClusterServers) -> None:
    sent: list[str] = []

    class Recording(HookedCluster):
        def around_command(self, send: Callable[[], Any]) -> Any:
            sent.append("command")
            return send()

    client = Recording.from_url(node_url(cluster.url))
    script = client.register_script("return redis.call('GET', KEYS[1])")
    try:
        sent.clear()  # the client's own, while it was made
        client.set("compat:key", "value")
        assert sent == ["command"]
        assert client.get("compat:key") == b"value"
        assert len(sent) == 2
        assert script(keys=["compat:key"]) == b"value"  # EVALSHA, maybe SCRIPT LOAD and again
        after_script = len(sent)
        assert after_script > 2
        client.publish("compat:channel", "hello")
        assert len(sent) == after_script + 1
    finally:
        client.close()


async def test_every_command_of_an_asyncio_cluster_client_passes_the_hook(
        cluster: RedisClusterServers) -> None:
    sent: list[str] = []

    class Recording(AsyncHookedCluster):
        async def around_command(self, send: Callable[[], Awaitable[Any]]) -> Any:
            sent.append("command")
            return await send()

    client = Recording.from_url(node_url(cluster.url))
    script = client.register_script("return redis.call('GET', KEYS[1])")
    try:
        await client.initialize()
        sent.clear()  # the client's own, while it read the slot map
        await client.set("compat:async", "value")
        assert sent == ["command"]
        assert await client.get("compat:async") == b"value"
        assert len(sent) == 2
        assert await script(keys=["compat:async"]) == b"value"
        after_script = len(sent)
        assert after_script > 2
        await client.incr("compat:count")
        assert len(sent) == after_script + 1
    finally:
        await client.aclose()


def test_a_stream_read_finds_its_keys_without_the_default_node(
        cluster: RedisClusterServers) -> None:
    # redis-py asks its default node for the keys of XREADGROUP; with that node
    # gone (here: one that never answers), a read, alone or pipelined, still
    # goes to the node of its stream.
    client = HookedCluster.from_url(node_url(cluster.url))
    gone = RedisServer(cluster=False)
    try:
        client.xgroup_create("compat:{q}", "g", id="0", mkstream=True)
        client.xgroup_create("compat:{q}:high", "g", id="0", mkstream=True)
        client.xadd("compat:{q}", {"n": "1"})
        gone_node = redis.cluster.ClusterNode("127.0.0.1", gone.port)
        gone_node.redis_connection = redis.Redis(port=gone.port)
        gone.close()
        client.nodes_manager.default_node = gone_node

        streams = {"compat:{q}": ">", "compat:{q}:high": ">"}
        assert [s for s, _ in client.xreadgroup("g", "c", streams, count=1)] == [b"compat:{q}"]
        client.xadd("compat:{q}:high", {"n": "2"})
        pipe = client.pipeline(transaction=False)
        pipe.xreadgroup("g", "c", {"compat:{q}": ">"}, count=1)
        pipe.xreadgroup("g", "c", {"compat:{q}:high": ">"}, count=1)
        assert [len(reply or []) for reply in pipe.execute()] == [0, 1]
        assert stream_read_keys(("XREADGROUP", "GROUP", "g", "STREAMS", "COUNT", "1",
                                 "STREAMS", "a", "b", ">", ">")) == ["a", "b"]
        assert stream_read_keys(("XREAD", "COUNT", "1", "STREAMS", "a", "0")) == ["a"]
        assert stream_read_keys(("XADD", "a", "*", "n", "1")) is None
    finally:
        client.nodes_manager.default_node = None
        client.close()


def _slot_map_reads(cluster: RedisClusterServers) -> int:
    reads = 0
    for node in cluster.nodes:
        probe = redis.Redis(port=node.port)
        stats = probe.info("commandstats")
        probe.close()
        reads += sum(int(stats.get(f"cmdstat_cluster|{sub}", {}).get("calls", 0))
                     for sub in ("slots", "shards", "nodes"))
    return reads


def test_refresh_slot_map_asks_a_node_for_the_map(cluster: RedisClusterServers) -> None:
    client = redis.cluster.RedisCluster.from_url(node_url(cluster.url))
    try:
        before = _slot_map_reads(cluster)
        refresh_slot_map(client)
        assert _slot_map_reads(cluster) > before
        assert client.ping()
    finally:
        client.close()


async def test_refresh_slot_map_async_asks_a_node_for_the_map(
        cluster: RedisClusterServers) -> None:
    client = aioredis.RedisCluster.from_url(node_url(cluster.url))
    try:
        await client.initialize()
        before = _slot_map_reads(cluster)
        await refresh_slot_map_async(client)
        assert _slot_map_reads(cluster) > before
        assert await client.ping()
    finally:
        await client.aclose()


async def _write_after(close: Callable[[aioredis.Connection], Awaitable[None]],
                       server: RedisServer) -> BaseException:
    """The error of a command written on a connection that ``close`` closed
    between the connection's health check and its write, as another task does."""
    connection = aioredis.Connection(port=server.port, socket_timeout=5)
    await connection.connect()

    async def closed_by_another_task() -> None:
        await close(connection)

    connection.check_health = closed_by_another_task  # type: ignore[method-assign]
    # redis-py 8.2 and newer raise a ConnectionError of their own; older ones
    # an AttributeError or RuntimeError out of the closed writer.
    with pytest.raises((AttributeError, RuntimeError, redis.exceptions.ConnectionError)) as caught:
        await connection.send_command("PING")
    await connection.disconnect()
    return caught.value


async def test_a_write_on_a_connection_closed_under_it_is_recognised(
        redis_server: RedisServer) -> None:
    async def disconnect(connection: aioredis.Connection) -> None:
        await connection.disconnect()

    error = await _write_after(disconnect, redis_server)
    assert isinstance(error, Exception) and closed_under_write(error)


def test_a_write_on_a_closing_uvloop_transport_is_recognised(redis_server: RedisServer) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def disconnecting(connection: aioredis.Connection) -> None:
        # disconnect() closes the transport, then waits for it to close: the
        # write comes in between.
        asyncio.ensure_future(connection.disconnect())
        await asyncio.sleep(0)  # a yield, no wait: the disconnect runs to its first await

    error = uvloop.run(_write_after(disconnecting, redis_server))
    assert isinstance(error, Exception) and closed_under_write(error)


def test_other_errors_are_not_taken_for_a_closed_connection() -> None:
    assert not closed_under_write(AttributeError("'Foo' object has no attribute 'bar'"))
    assert not closed_under_write(ValueError("the handler is closed"))


async def test_an_asyncio_pubsub_subscribes_a_shard_channel(redis_server: RedisServer) -> None:
    client = aioredis.Redis(port=redis_server.port, health_check_interval=30)
    pubsub = client.pubsub()

    async def next_message() -> dict[str, Any]:
        async with asyncio.timeout(10):
            while (message := await pubsub.get_message(timeout=1.0)) is None:
                pass
        return dict(message)

    try:
        await shard_pubsub_command(pubsub, "ssubscribe", b"compat:shard")
        assert (await next_message())["type"] == "ssubscribe"
        await client.spublish("compat:shard", "hello")
        message = await next_message()
        assert (message["type"], message["channel"], message["data"]) == (
            "smessage", b"compat:shard", b"hello")
        await shard_pubsub_command(pubsub, "sunsubscribe", b"compat:shard")
        assert (await next_message())["type"] == "sunsubscribe"
    finally:
        await pubsub.aclose()
        await client.aclose()
