"""The uvicorn shim (``tokenfleet.shared.compat.uvicorn_h11``) against the uvicorn
installed: the hooks it overrides are still uvicorn's and still called, and on a
real socket a head that does not come in time ends its connection (with a 408 if
part of it came), the next head's clock starting when a response has gone out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import pytest
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from tokenfleet.shared.compat.uvicorn_h11 import (
    HEAD_TOO_LARGE,
    HOOKS,
    MAX_HEAD_BYTES,
    REQUEST_TIMEOUT,
    HeadDeadlineProtocol,
    head_deadline_protocol,
)

pytestmark = pytest.mark.timeout(60)

HEAD_TIMEOUT_S = 0.3
# A bound on a read the test waits for, so that a broken shim fails instead of hanging.
READ_BOUND_S = 30.0


async def ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def serving() -> AsyncIterator[tuple[int, list[HeadDeadlineProtocol]]]:
    """uvicorn's protocol with the shim's deadline on a loopback port (uvicorn's own
    keep-alive timeout far off), and the protocol of each connection."""
    config = Config(ok_app, lifespan="off", timeout_keep_alive=600, log_level="warning")
    config.load()
    state, protocol = ServerState(), head_deadline_protocol(HEAD_TIMEOUT_S)
    made: list[HeadDeadlineProtocol] = []

    def factory() -> HeadDeadlineProtocol:
        made.append(protocol(config, state, {}))
        return made[-1]

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], made
    finally:
        server.close()
        await server.wait_closed()


async def everything_until_closed(port: int, send: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(send)
        return await asyncio.wait_for(reader.read(), READ_BOUND_S)
    finally:
        writer.close()


def test_uvicorn_still_defines_every_hook_the_shim_overrides() -> None:
    for name in HOOKS:
        assert callable(getattr(H11Protocol, name, None)), f"uvicorn's H11Protocol lost {name}()"
        assert name in vars(HeadDeadlineProtocol), f"the shim no longer overrides {name}()"


async def test_a_connection_that_sends_nothing_is_closed_without_a_word() -> None:
    async with serving() as (port, made):
        assert await everything_until_closed(port, b"") == b""
        # What the shim reads of uvicorn's protocol is where it looks for it.
        protocol = made[0]
        assert isinstance(protocol.conn, h11.Connection)
        assert protocol.loop is asyncio.get_running_loop()
        assert protocol.transport is not None


async def test_part_of_a_head_not_finished_in_time_gets_a_408() -> None:
    async with serving() as (port, _made):
        got = await everything_until_closed(port, b"GET / HTTP/1.1\r\nhost: test\r\n")
        assert got == REQUEST_TIMEOUT


async def test_the_next_heads_clock_starts_when_a_response_has_gone_out() -> None:
    async with serving() as (port, _made):
        got = await everything_until_closed(port, b"GET / HTTP/1.1\r\nhost: test\r\n\r\n")
        # Answered, then closed by the head deadline re-armed after the response
        # (uvicorn's keep-alive would hold it for minutes).
        assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"\r\n\r\nok")


@pytest.mark.parametrize("pieces", [1, 40])
async def test_a_head_over_16_kib_gets_a_431_whether_it_comes_whole_or_in_pieces(
        pieces: int) -> None:
    # h11 bounds only an incomplete head: one that arrived whole in one read
    # was served at ~100 KB.
    head = b"GET / HTTP/1.1\r\nhost: test\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n"
    async with serving() as (port, _made):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            step = -(-len(head) // pieces)
            for at in range(0, len(head), step):
                writer.write(head[at:at + step])
                await writer.drain()
            got = await asyncio.wait_for(reader.read(), READ_BOUND_S)
        finally:
            writer.close()
        assert got == HEAD_TOO_LARGE and str(MAX_HEAD_BYTES).encode() in got


async def test_a_head_just_within_16_kib_is_served() -> None:
    start = b"GET / HTTP/1.1\r\nhost: test\r\nx-big: "
    filler = MAX_HEAD_BYTES - len(start) - 4
    async with serving() as (port, _made):
        got = await everything_until_closed(port, start + b"a" * filler + b"\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 ")
