"""The n jobs of one OpenAI request (``n`` choices): waited for together, and
their streams merged into one, each batch of events tagged with its choice's
index. Nothing here formats a response: ``tokenfleet.gateway.answer`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import anyio
from fastapi import Request
from redis.exceptions import RedisError

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.shared.wire.errors import TokenfleetError
from tokenfleet.shared.wire.schemas import JobState, TokenEvent

# What a follower hands the merge: a batch of events, None at its stream's
# end, or the error that broke it.
Item = tuple[int, "list[TokenEvent] | None | BaseException"]


async def merged_batches(client: AsyncFleetClient, job_ids: list[str]
                         ) -> AsyncGenerator[tuple[int, list[TokenEvent] | None], None]:
    """``(choice index, events)`` from every job as they come, each job's in
    order; ``(index, None)`` once that job's stream has ended. An error of one
    stream is raised here (the others stop)."""
    if len(job_ids) == 1:  # the common case: no tasks, no queue
        async for events in client.stream_batches(job_ids[0]):
            yield 0, events
        yield 0, None
        return
    # Bounded: a reader that falls behind holds its followers back, not memory.
    queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=4 * len(job_ids))

    async def follow(index: int, job_id: str) -> None:
        try:
            async for events in client.stream_batches(job_id):
                await queue.put((index, events))
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(follow(i, j)) for i, j in enumerate(job_ids)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            left -= item is None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_while_connected(client: AsyncFleetClient, job_ids: list[str],
                               request: Request) -> list[JobState] | None:
    """Every job's final state, in order, or None (and the jobs cancelled) if
    the client left first."""
    async def wait_all() -> list[JobState]:
        return list(await asyncio.gather(*(client.wait(j) for j in job_ids)))

    waiter = asyncio.ensure_future(wait_all())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        finished = waiter.done()
        if not finished:
            waiter.cancel()
    if finished:
        return waiter.result()
    await cancel_quietly(client, job_ids)
    return None


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_quietly(client: AsyncFleetClient, job_ids: list[str]) -> None:
    # Shielded: this runs while the request's task is being cancelled. Nobody
    # waits for the outcome, so the cancel is asked for and not waited on.
    with anyio.CancelScope(shield=True):
        for job_id in job_ids:
            with contextlib.suppress(TokenfleetError, RedisError):
                await client.cancel(job_id, timeout=0)
