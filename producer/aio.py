"""The asyncio client, for async web backends: the same methods, awaitable."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from tokenfleet.protocol import (
    CANCEL_WAIT_S,
    EventCursor,
    as_read,
    build_request,
    cancel_call,
    cancel_verdict,
    check_deadline,
    expires_at,
    is_end_payload,
    parse_state,
    require_worker_for,
    served_queues,
    submission,
    submitted_id,
    time_slice,
)
from tokenfleet.shared.client_scripts import CancelVerdict
from tokenfleet.shared.errors import JobNotFound, NoWorker
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.liveness import live_since
from tokenfleet.shared.redis_conn import connect_async
from tokenfleet.shared.redis_pool import PoolBound
from tokenfleet.shared.schemas import GenerationRequest, JobState, JobStatus, TokenEvent
from tokenfleet.shared.settings import Settings, get_settings
from tokenfleet.subscriptions import Subscriptions


class AsyncFleetClient:
    """``async with AsyncFleetClient(url) as client: ...``; see ``FleetClient``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str | None = None,
        settings: Settings | None = None,
        bound: PoolBound | None = None,
    ) -> None:
        """``bound``: at most that many Redis connections, event streams' included,
        a command waiting for a free one (``RedisBusy`` past the wait), idle ones
        closed; None: redis-py's pool, which keeps every connection it opened."""
        self.settings = settings or get_settings()
        # redis-py types replies as bytes | str; with decode_responses off they are bytes.
        self.redis: Any = connect_async(url or self.settings.redis_url, bound)
        self.keys = Keys(namespace or self.settings.namespace)
        self._subscriptions = Subscriptions(self.redis)

    async def __aenter__(self) -> AsyncFleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._subscriptions.close()
        await self.redis.aclose()

    async def submit(self, prompt: str | GenerationRequest | None = None, /, *,
                     require_worker: bool | None = None, **kwargs: Any) -> str:
        """See ``FleetClient.submit``: ``NoWorker`` unless a live worker serves the
        queue or ``require_worker=False``; ``IdempotencyConflict``; ``QueueFull``."""
        request = build_request(prompt, kwargs, self.settings)
        sub = submission(request, self.keys, self.settings,
                         require_worker_for(require_worker, self.settings))
        job_id = submitted_id(await sub.call.run_async(self.redis), request, self.settings)
        if job_id is None:
            raise NoWorker(request.model, await self.served_queues())
        return job_id

    async def served_queues(self) -> list[str]:
        """The queues at least one live worker serves now."""
        names = [n async for n in self.redis.scan_iter(match=self.keys.served_pattern(),
                                                        count=500)]
        pipe = self.redis.pipeline(transaction=False)
        since = live_since()
        for name in names:
            pipe.zcount(name, since, "+inf")
        return served_queues(names, await pipe.execute() if names else [], self.keys)

    async def status(self, job_id: str) -> JobState:
        """See ``FleetClient.status``: a read; a job queued past its deadline
        reads as expired."""
        return as_read(parse_state(job_id, await self.redis.hgetall(self.keys.job(job_id))))

    async def cancel(self, job_id: str, timeout: float = CANCEL_WAIT_S) -> bool:
        """See ``FleetClient.cancel``: True only if the job ended ``cancelled``; a
        running job is waited for up to ``timeout`` seconds."""
        # The queue's key goes to the script with the others (declared keys only).
        model, priority = await self.redis.hmget(self.keys.job(job_id), ["model", "priority"])
        if model is None:
            raise JobNotFound(job_id)
        call = cancel_call(job_id, model.decode(), (priority or b"normal").decode(),
                           self.keys, self.settings)
        verdict = cancel_verdict(await call.run_async(self.redis), job_id)
        if verdict is not CancelVerdict.REQUESTED:
            return verdict is CancelVerdict.CANCELLED
        try:
            state = await self.wait(job_id, timeout=timeout)
        except TimeoutError:
            return False
        return state.status is JobStatus.CANCELLED

    async def wait(self, job_id: str, timeout: float | None = None) -> JobState:
        deadline = None if timeout is None else time.monotonic() + timeout
        # The end channel: a waiter hears one message, not one per token.
        async with self._subscriptions.listen(self.keys.ends(job_id)) as messages:
            while True:
                state = await self.status(job_id)
                if state.status.is_terminal:
                    return state
                # Listen until the end message or a quiet interval (or a queued
                # job's deadline), then read the record again.
                wake = expires_at(state)
                while True:
                    payload = await _next(messages, deadline, wake)
                    if payload is None or is_end_payload(payload):
                        break
                check_deadline(deadline, job_id)

    async def stream(self, job_id: str, timeout: float | None = None
                     ) -> AsyncGenerator[TokenEvent, None]:
        async with contextlib.aclosing(self.stream_batches(job_id, timeout)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event

    async def stream_batches(self, job_id: str, timeout: float | None = None
                             ) -> AsyncGenerator[list[TokenEvent], None]:
        """``stream``'s events in lists: each time, every event in by then. A
        reader that falls behind (the gateway on a busy host) takes the backlog
        in one go and can write it out as one frame."""
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor = EventCursor()
        async with self._subscriptions.listen(self.keys.events(job_id)) as messages:
            await self._catch_up(job_id, cursor)
            if events := cursor.take():
                yield events
            while not cursor.ended:
                payload = await _next(messages, deadline, cursor.expires_at)
                if payload is None or not cursor.feed(payload):
                    await self._catch_up(job_id, cursor)
                while not cursor.ended and not messages.empty():
                    if not cursor.feed(messages.get_nowait()):
                        await self._catch_up(job_id, cursor)
                if events := cursor.take():
                    yield events
                if not cursor.ended:
                    check_deadline(deadline, job_id)

    async def _catch_up(self, job_id: str, cursor: EventCursor) -> None:
        log = self.keys.out(job_id)
        cursor.feed_log(await self.redis.xrange(log, cursor.log_after(), "+"))
        if cursor.ended:
            return
        state = await self.status(job_id)  # an overdue job reads as expired
        cursor.expires_at = expires_at(state)
        if state.status.is_terminal:
            cursor.feed_log(await self.redis.xrange(log, cursor.log_after(), "+"))
            cursor.ended = True


async def _next(messages: asyncio.Queue[bytes], deadline: float | None,
                wake: float | None = None) -> bytes | None:
    """The next message, or None after a quiet interval (see ``time_slice``)."""
    if not messages.empty():  # no timer to arm: the common case under load
        return messages.get_nowait()
    # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel
    # that arrives as the message does, and a cancelled stream would run on.
    try:
        async with asyncio.timeout(time_slice(deadline, wake)):
            return await messages.get()
    except TimeoutError:
        return None
