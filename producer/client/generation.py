"""One job from submit to end, tied to the code that consumes it.

A web backend streams a job's tokens to an HTTP client; when that client goes
away the framework cancels the task that was streaming, and a plain
``finally: await client.cancel(job_id)`` is cancelled in its turn before it
reaches Redis (anyio cancels every await inside a cancelled scope), so the job
runs to its end for no one. ``generation()`` ties the job to a ``with`` block:
leaving the block before the job ended, for whatever reason, asks the fleet to
cancel it, on a task of its own that the caller's cancellation does not reach.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterator
from typing import TYPE_CHECKING, Any

from tokenfleet.shared.wire.schemas import EndEvent, TokenEvent

if TYPE_CHECKING:
    from tokenfleet.client.aio import AsyncFleetClient
    from tokenfleet.client.sync import FleetClient

Submit = Callable[[], Coroutine[Any, Any, str]]


class Generation:
    """``with client.generation(prompt, ...) as gen: for event in gen: ...``

    The job is submitted on entering the block (or by ``start()``; ``job_id``); iterating yields the job's
    ``TokenEvent``s; afterwards ``end`` holds its ``EndEvent`` (status, finish
    reason, error) and ``text`` the text streamed. Leaving the block before the
    job ended cancels it (without waiting for the worker to stop it).
    """

    def __init__(self, client: FleetClient, submit: Callable[[], str]) -> None:
        self.client, self._submit = client, submit
        self.job_id = ""
        self.text = ""
        self.end: EndEvent | None = None
        self._events: Generator[TokenEvent, None, None] | None = None

    def start(self) -> str:
        """Submit the job (once), before the block if refusals must come first."""
        if not self.job_id:
            self.job_id = self._submit()
        return self.job_id

    def __enter__(self) -> Generation:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.end is None:
            self.client.cancel(self.job_id, timeout=0)
        if self._events is not None:
            self._events.close()  # unsubscribes

    def __iter__(self) -> Iterator[TokenEvent]:
        self._events = self._follow()
        return self._events

    def _follow(self) -> Generator[TokenEvent, None, None]:
        for event in self.client.stream(self.job_id, final=True):
            if isinstance(event, EndEvent):
                self.end = event
            else:
                self.text += event.text
                yield event


class AsyncGeneration:
    """``async with client.generation(prompt, ...) as gen: async for event in gen: ...``

    As ``Generation``; the job is submitted on entering the block (or by ``start()``
    before it), and leaving it
    early (the consumer stopped, an exception, the task cancelled) cancels the job
    on a task the caller's cancellation does not reach.
    """

    def __init__(self, client: AsyncFleetClient, submit: Submit) -> None:
        self.client, self._submit = client, submit
        self.job_id = ""
        self.text = ""
        self.end: EndEvent | None = None
        self._events: AsyncGenerator[TokenEvent, None] | None = None

    async def start(self) -> str:
        """Submit the job (once): a web backend calls it before it starts its
        response, so that a refusal (``InvalidRequest``, ``QueueFull``, ``NoWorker``)
        becomes an HTTP error rather than a stream cut short."""
        if not self.job_id:
            self.job_id = await self._submit()
        return self.job_id

    async def __aenter__(self) -> AsyncGeneration:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.end is None or self._events is not None:
            # Shielded: under a cancelled scope the await below is cancelled again
            # at once, but the task goes on and the client's close() awaits it.
            await asyncio.shield(self.client.in_background(self._release()))

    async def _release(self) -> None:
        if self.end is None:
            await self.client.cancel(self.job_id, timeout=0)
        if self._events is not None:
            await self._events.aclose()  # unsubscribes
            self._events = None

    def __aiter__(self) -> AsyncGenerator[TokenEvent, None]:
        self._events = self._follow()
        return self._events

    async def _follow(self) -> AsyncGenerator[TokenEvent, None]:
        async with contextlib.aclosing(self.client.stream(self.job_id, final=True)) as events:
            async for event in events:
                if isinstance(event, EndEvent):
                    self.end = event
                else:
                    self.text += event.text
                    yield event
