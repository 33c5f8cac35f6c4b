"""The asyncio client, for async web backends: the same methods, awaitable."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenfleet.subscriptions import Subscriptions
from tokenfleet.protocol import (
    EventCursor,
    build_request,
    check_deadline,
    cancel_args,
    cancelled,
    is_end_payload,
    live_worker_args,
    parse_state,
    submission,
    submitted_id,
    time_slice,
)
from tokenfleet.shared.errors import JobNotFound, NoWorker
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.redis_conn import connect_async
from tokenfleet.shared.schemas import GenerationRequest, JobState, TokenEvent
from tokenfleet.shared.scripts import Scripts
from tokenfleet.shared.settings import Settings, get_settings


class AsyncFleetClient:
    """``async with AsyncFleetClient(url) as client: ...``; see ``FleetClient``."""

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        # redis-py types replies as bytes | str; with decode_responses off they are bytes.
        self.redis: Any = connect_async(url or self.settings.redis_url)
        self.keys = Keys(namespace or self.settings.namespace)
        self._scripts = Scripts(self.redis)
        self._subscriptions = Subscriptions(self.redis)

    async def __aenter__(self) -> AsyncFleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._subscriptions.close()
        await self.redis.aclose()

    async def submit(self, prompt: str | GenerationRequest | None = None, /, *,
                     require_worker: bool = False, **kwargs: Any) -> str:
        request = build_request(prompt, kwargs, self.settings)
        if require_worker:
            key, since = live_worker_args(request.model, self.keys)
            if not await self.redis.zcount(key, since, "+inf"):
                raise NoWorker(request.model)
        sub = submission(request, self.keys, self.settings)
        result = await self._scripts.submit(keys=sub.keys, args=sub.args)
        return submitted_id(result, request.model, self.settings)

    async def status(self, job_id: str) -> JobState:
        return parse_state(job_id, await self.redis.hgetall(self.keys.job(job_id)))

    async def cancel(self, job_id: str) -> bool:
        # The queue's key goes to the script with the others (declared keys only).
        model, priority = await self.redis.hmget(self.keys.job(job_id), ["model", "priority"])
        if model is None:
            raise JobNotFound(job_id)
        keys, args = cancel_args(job_id, model.decode(), (priority or b"normal").decode(),
                                 self.keys, self.settings)
        return cancelled(await self._scripts.cancel(keys=keys, args=args), job_id)

    async def wait(self, job_id: str, timeout: float | None = None) -> JobState:
        deadline = None if timeout is None else time.monotonic() + timeout
        async with self._subscriptions.listen(self.keys.events(job_id)) as messages:
            while True:
                state = await self.status(job_id)
                if state.status.is_terminal:
                    return state
                # Token messages do not change the status: listen on until the
                # end message or a quiet interval, then read the record again.
                while True:
                    payload = await _next(messages, deadline)
                    if payload is None or is_end_payload(payload):
                        break
                check_deadline(deadline, job_id)

    async def stream(self, job_id: str, timeout: float | None = None) -> AsyncIterator[TokenEvent]:
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor = EventCursor()
        async with self._subscriptions.listen(self.keys.events(job_id)) as messages:
            await self._catch_up(job_id, cursor)
            for event in cursor.take():
                yield event
            while not cursor.ended:
                payload = await _next(messages, deadline)
                if payload is None or not cursor.feed(payload):
                    await self._catch_up(job_id, cursor)
                for event in cursor.take():
                    yield event
                if not cursor.ended:
                    check_deadline(deadline, job_id)

    async def _catch_up(self, job_id: str, cursor: EventCursor) -> None:
        log = self.keys.out(job_id)
        cursor.feed_log(await self.redis.xrange(log, cursor.log_after(), "+"))
        if cursor.ended:
            return
        state = await self.status(job_id)
        if state.status.is_terminal:
            cursor.feed_log(await self.redis.xrange(log, cursor.log_after(), "+"))
            cursor.ended = True


async def _next(messages: asyncio.Queue[bytes], deadline: float | None) -> bytes | None:
    """The next message, or None after a quiet interval."""
    try:
        return await asyncio.wait_for(messages.get(), timeout=time_slice(deadline))
    except asyncio.TimeoutError:
        return None
