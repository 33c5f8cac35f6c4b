"""The gateway's SSE framing: keep-alives around a source that may be slow, fail or be cut off."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tokenfleet.gateway.sse import KEEPALIVE, with_keepalive


async def collect(frames: AsyncIterator[bytes]) -> list[bytes]:
    return [frame async for frame in frames]


async def test_a_quiet_source_gets_keep_alives_and_loses_no_frame() -> None:
    go = asyncio.Event()

    async def source() -> AsyncIterator[bytes]:
        yield b"a"
        await go.wait()
        yield b"b"

    out = with_keepalive(source(), interval=0.01)
    assert await anext(out) == b"a"
    assert await anext(out) == KEEPALIVE
    assert await anext(out) == KEEPALIVE
    go.set()
    frames = await asyncio.wait_for(collect(out), timeout=5)
    assert [f for f in frames if f != KEEPALIVE] == [b"b"]


async def test_frames_that_piled_up_go_out_as_one_write_in_order() -> None:
    async def source() -> AsyncIterator[bytes]:
        for i in range(5):
            yield b"%d;" % i

    out = with_keepalive(source(), interval=5)
    await asyncio.sleep(0)  # the source runs ahead while nobody reads
    assert await asyncio.wait_for(collect(out), timeout=5) == [b"0;1;2;3;4;"]


async def test_a_failing_source_sends_its_frames_then_raises_its_error() -> None:
    async def source() -> AsyncIterator[bytes]:
        yield b"a"
        raise ValueError("the job's record is gone")

    out = with_keepalive(source(), interval=5)
    assert await asyncio.wait_for(anext(out), timeout=5) == b"a"
    with pytest.raises(ValueError, match="record is gone"):
        await asyncio.wait_for(anext(out), timeout=5)


@pytest.mark.parametrize("stopped_at", ["a wait", "a yield"])
async def test_a_stream_cut_off_runs_its_sources_cleanup(stopped_at: str) -> None:
    # A client that hangs up: the source's cleanup (its subscription's) must run,
    # whether it was waiting for its next frame or had one waiting to be read.
    cleaned = asyncio.Event()
    never = asyncio.Event()

    async def source() -> AsyncIterator[bytes]:
        try:
            yield b"a"
            if stopped_at == "a yield":
                yield b"b"
            await never.wait()
        finally:
            cleaned.set()

    out = with_keepalive(source(), interval=5)
    assert await asyncio.wait_for(anext(out), timeout=5) in (b"a", b"ab")
    await out.aclose()
    await asyncio.wait_for(cleaned.wait(), timeout=5)


async def test_a_stream_that_keeps_sending_gets_no_keep_alive() -> None:
    # The keep-alive clock counts from the last thing sent, not from the start.
    async def source() -> AsyncIterator[bytes]:
        for i in range(12):
            await asyncio.sleep(0.05)  # the pace of a slow job's tokens, well inside 0.3 s
            yield b"%d;" % i

    frames = await asyncio.wait_for(collect(with_keepalive(source(), interval=0.3)), timeout=10)
    assert KEEPALIVE not in frames
    assert b"".join(frames) == b"".join(b"%d;" % i for i in range(12))
