"""The asyncio client, for async web backends: the same methods, awaitable."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
)
from typing import Any, Literal, cast, overload

from redis.exceptions import RedisError

from tokenfleet.client import batches as batch_client
from tokenfleet.client.batches import Request as BatchRequest
from tokenfleet.client.batch_records import Batch
from tokenfleet.client.choices import check_n, choice_requests
from tokenfleet.client.prompt_tokens import count_prompt_tokens, worth_counting
from tokenfleet.client.protocol import (
    CANCEL_WAIT_S,
    EventCursor,
    as_read,
    build_request,
    CANCEL_FIELDS,
    KnownTenants, QueuePartitions,
    cancel_call,
    cancel_verdict,
    check_deadline,
    expires_at,
    is_end_payload,
    no_worker,
    parse_state,
    refuse_uncompilable,
    require_worker_for,
    served_queues,
    submission,
    submitted_id,
    time_slice,
)
from tokenfleet.shared.wire.client_scripts import CancelVerdict
from tokenfleet.shared.redis.clock import FleetClock
from tokenfleet.shared.wire.errors import JobNotFound, TokenfleetError
from tokenfleet.shared.grammar_check import GrammarCheck
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.redis.liveness import live_since
from tokenfleet.shared.redis.connect import connect_async
from tokenfleet.shared.redis.pool import PoolBound
from tokenfleet.shared.wire.schemas import EndEvent, GenerationRequest, JobState, JobStatus, TokenEvent
from tokenfleet.shared.settings import Settings, get_settings
from tokenfleet.client.generation import AsyncGeneration
from tokenfleet.client.served import served
from tokenfleet.client.shard_subscriptions import ShardedSubscriptions
from tokenfleet.shared.redis.cluster import AsyncCluster, ChannelMoved
from tokenfleet.client.subscriptions import MOVED, Subscriptions


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
        closed; None: 100 connections and a wait of 30 s
        (``tokenfleet.shared.redis.connect``), so a burst of submits waits its turn."""
        self.settings = settings or get_settings()
        # redis-py types replies as bytes | str; with decode_responses off they are bytes.
        self.redis: Any = connect_async(url or self.settings.redis_url, bound)
        self.keys = Keys.for_url(namespace or self.settings.namespace, url or self.settings.redis_url)
        self._subscriptions: Subscriptions | ShardedSubscriptions = (
            ShardedSubscriptions(cast(AsyncCluster, self.redis)) if self.keys.sharded
            else Subscriptions(self.redis))
        self._background: set[asyncio.Task[Any]] = set()  # strong references, awaited by close()
        # Deadlines and liveness are judged on Redis's clock, not this host's.
        self.clock = FleetClock()
        self._tenants = KnownTenants()  # of each queue, for submit's depth
        self._partitions = QueuePartitions()  # of each queue, where a job goes
        self._grammars = GrammarCheck()  # whether a structured output compiles

    async def __aenter__(self) -> AsyncFleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._background:  # a generation's cancel, on its way to Redis
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._subscriptions.close()
        await self.redis.aclose()
        self._grammars.close()

    async def submit(self, prompt: str | GenerationRequest | None = None, /, *,
                     require_worker: bool | None = None,
                     prompt_tokens: int | None = None, tenant: str | None = None,
                     **kwargs: Any) -> str:
        """See ``FleetClient.submit``: ``NoWorker`` unless a live worker serves the
        queue or ``require_worker=False``; ``IdempotencyConflict``; ``QueueFull``; ``tenant``;
        ``LimitExceeded`` (``PromptTooLong``: the prompt's tokens counted here
        where the queue's model is on this machine)."""
        request = build_request(prompt, kwargs, self.settings, tenant)
        if request.structured_output is not None:
            # Off the loop, within TOKENFLEET_GRAMMAR_COMPILE_S: a schema can take
            # seconds to compile. At the gateway this runs after the key's limits.
            refuse_uncompilable(await self._grammars.aproblem(
                request.structured_output, self.settings.grammar_compile_s))
        if prompt_tokens is None and worth_counting(request, self.settings):
            queue = await served(self, request.model)
            if queue is not None:  # tokenizing a long prompt takes a while: off the loop
                prompt_tokens = await asyncio.to_thread(count_prompt_tokens, request,
                                                        queue.models)
        now = await self.clock.aread(self.redis)
        while True:  # again only when a tenant new to this client queued meanwhile
            sub = submission(request, self.keys, self.settings,
                             require_worker_for(require_worker, self.settings),
                             now, prompt_tokens, self._tenants.of(request.model),
                             await self.partitions(request.model), self._partitions.turn())
            result = await sub.call.run_async(self.redis)
            if not self._tenants.heard(request.model, result):
                break
        job_id = submitted_id(result, request, self.settings)
        if job_id is None:
            raise no_worker(request, result, await self.served_queues(), now, self.settings)
        return job_id

    async def submit_choices(self, prompt: str | GenerationRequest | None = None, /, *,
                             n: int, require_worker: bool | None = None,
                             **kwargs: Any) -> list[str]:
        """See ``FleetClient.submit_choices``: the n job ids, choice 0 first;
        queued whole or not at all."""
        check_n(n, self.settings)
        request = build_request(prompt, kwargs, self.settings)

        async def submit(choice: GenerationRequest) -> str:
            return await self.submit(choice, require_worker=require_worker)
        return await self.submit_whole(choice_requests(request, n), submit)

    async def submit_whole(self, requests: list[GenerationRequest],
                           submit: Callable[[GenerationRequest], Awaitable[str]]) -> list[str]:
        """Each of ``requests`` through ``submit``, in order: all queued, or (one
        refused, or the caller cancelled) none left running."""
        job_ids: list[str] = []
        try:
            for request in requests:
                job_ids.append(await submit(request))
        except BaseException:
            # Shielded: a cancelled caller must not leave the earlier choices running.
            await asyncio.shield(self.in_background(self._cancel_all(job_ids)))
            raise
        return job_ids

    async def _cancel_all(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            with contextlib.suppress(TokenfleetError, RedisError):
                await self.cancel(job_id, timeout=0)

    def generation(self, prompt: str | GenerationRequest | None = None, /, *,
                   require_worker: bool | None = None, **kwargs: Any) -> AsyncGeneration:
        """``async with client.generation(prompt, ...) as gen: async for event in gen:``:
        the job is submitted on entering the block (as ``submit``) and cancelled if
        the block is left before it ended, even when the task is being cancelled (a
        web framework cancels the streaming task when the HTTP client leaves)."""
        async def submit() -> str:
            return await self.submit(prompt, require_worker=require_worker, **kwargs)
        return AsyncGeneration(self, submit)

    def in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` on a task of its own, which ``close()`` waits for."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def submit_batch(self, requests: Iterable[BatchRequest] | AsyncIterable[BatchRequest],
                           *, endpoint: str | None = None, completion_window: str = "24h",
                           metadata: dict[str, str] | None = None,
                           tenant: str | None = None) -> Batch:
        """Stream ``requests`` (batch-file lines as dicts, or ``GenerationRequest``s)
        into the file store and create a batch of them; a batch driver runs it
        (every gateway runs one; ``tokenfleet batch drive`` without one). The
        endpoint is the first request's unless given."""
        return await batch_client.submit_batch(self, requests, endpoint=endpoint,
                                               completion_window=completion_window,
                                               metadata=metadata, tenant=tenant)

    async def batch(self, batch_id: str, *, tenant: str | None = None) -> Batch:
        """The batch (``KeyError`` when there is none of the tenant's)."""
        return await batch_client.batch(self, batch_id, tenant)

    async def cancel_batch(self, batch_id: str, *, tenant: str | None = None) -> Batch:
        """Ask for the batch to be cancelled: finished lines are kept."""
        return await batch_client.cancel(self, batch_id, tenant)

    def batch_results(self, batch_id: str, order: Literal["input", "finished"] = "finished",
                      *, tenant: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """The ended batch's result lines: output, then errors, streamed; or in input
        order (held in memory to sort them: about the size of the result files)."""
        return batch_client.aresults(self, batch_id, order, tenant)

    async def partitions(self, model: str) -> int:
        """See ``FleetClient.partitions``."""
        count = self._partitions.cached(model)
        if count is None:
            count = self._partitions.heard(model, await self.redis.get(
                self.keys.partitions(model)))
        return count

    async def served_queues(self) -> list[str]:
        """The queues at least one live worker serves now."""
        names = [n async for n in self.redis.scan_iter(match=self.keys.served_pattern(),
                                                        count=500)]
        pipe = self.redis.pipeline(transaction=False)
        since = live_since(await self.clock.aread(self.redis))
        for name in names:
            pipe.zcount(name, since, "+inf")
        return served_queues(names, await pipe.execute() if names else [], self.keys)

    async def status(self, job_id: str) -> JobState:
        """See ``FleetClient.status``: a read; a job queued past its deadline
        reads as expired."""
        fields = await self.redis.hgetall(self.keys.job(job_id))
        return as_read(parse_state(job_id, fields), await self.clock.aread(self.redis))

    async def cancel(self, job_id: str, timeout: float = CANCEL_WAIT_S) -> bool:
        """See ``FleetClient.cancel``: True only if the job ended ``cancelled``; a
        running job is waited for up to ``timeout`` seconds."""
        # The queue's key goes to the script with the others (declared keys only).
        record = await self.redis.hmget(self.keys.job(job_id), CANCEL_FIELDS)
        if record[0] is None:
            raise JobNotFound(job_id)
        call = cancel_call(job_id, record, self.keys, self.settings, await self.clock.aread(self.redis))
        verdict = cancel_verdict(await call.run_async(self.redis), job_id)
        if verdict is not CancelVerdict.REQUESTED:
            return verdict is CancelVerdict.CANCELLED
        if timeout <= 0:
            return False  # asked; the worker stops it at its next step
        try:
            state = await self.wait(job_id, timeout=timeout)
        except TimeoutError:
            return False
        return state.status is JobStatus.CANCELLED

    async def wait(self, job_id: str, timeout: float | None = None) -> JobState:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with contextlib.suppress(ChannelMoved):  # listened to again where it lives now
                return await self._wait(job_id, deadline)

    async def _wait(self, job_id: str, deadline: float | None) -> JobState:
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
                    payload = await _next(messages, deadline, wake, self.clock.now())
                    if payload is None or is_end_payload(payload):
                        break
                check_deadline(deadline, job_id)

    @overload
    def stream(self, job_id: str, timeout: float | None = None, *,
               final: Literal[False] = False) -> AsyncGenerator[TokenEvent, None]: ...
    @overload
    def stream(self, job_id: str, timeout: float | None = None, *,
               final: Literal[True]) -> AsyncGenerator[TokenEvent | EndEvent, None]: ...

    async def stream(self, job_id: str, timeout: float | None = None, *,
                     final: bool = False) -> AsyncGenerator[TokenEvent | EndEvent, None]:
        """See ``FleetClient.stream``; ``final=True`` ends with the ``EndEvent``."""
        cursor = EventCursor()
        async with contextlib.aclosing(self._batches(job_id, timeout, cursor)) as batches:
            async for batch in batches:
                for event in batch:
                    yield event
        if final:
            assert cursor.final is not None  # set whenever the cursor ends
            yield cursor.final

    def stream_batches(self, job_id: str, timeout: float | None = None
                       ) -> AsyncGenerator[list[TokenEvent], None]:
        """``stream``'s events in lists: each time, every event in by then. A
        reader that falls behind (the gateway on a busy host) takes the backlog
        in one go and can write it out as one frame."""
        return self._batches(job_id, timeout, EventCursor())

    async def _batches(self, job_id: str, timeout: float | None, cursor: EventCursor
                       ) -> AsyncGenerator[list[TokenEvent], None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not cursor.ended:
            try:
                async with self._subscriptions.listen(self.keys.events(job_id)) as messages:
                    await self._catch_up(job_id, cursor)
                    if events := cursor.take():
                        yield events
                    while not cursor.ended:
                        payload = await _next(messages, deadline, cursor.expires_at,
                                              self.clock.now())
                        if payload is None or not cursor.feed(payload):
                            await self._catch_up(job_id, cursor)
                        while not cursor.ended and not messages.empty():
                            if not cursor.feed(_moved_or(messages.get_nowait())):
                                await self._catch_up(job_id, cursor)
                        if events := cursor.take():
                            yield events
                        if not cursor.ended:
                            check_deadline(deadline, job_id)
            except ChannelMoved:
                continue  # listened to again where it lives now, from the cursor on

    async def _catch_up(self, job_id: str, cursor: EventCursor) -> None:
        log = self.keys.out(job_id)
        cursor.feed_log(await self.redis.xrange(log, cursor.log_after(), "+"))
        if cursor.ended:
            return
        state = await self.status(job_id)  # an overdue job reads as expired
        cursor.expires_at = expires_at(state)
        if state.status.is_terminal:
            cursor.feed_log(await self.redis.xrange(log, cursor.log_after(), "+"))
            cursor.end_from(state)


async def _next(messages: asyncio.Queue[bytes], deadline: float | None,
                wake: float | None = None, now: float | None = None) -> bytes | None:
    """The next message, or None after a quiet interval (see ``time_slice``;
    ``wake`` and ``now`` on Redis's clock)."""
    if not messages.empty():  # no timer to arm: the common case under load
        return _moved_or(messages.get_nowait())
    # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel
    # that arrives as the message does, and a cancelled stream would run on.
    try:
        async with asyncio.timeout(time_slice(deadline, wake, now)):
            return _moved_or(await messages.get())
    except TimeoutError:
        return None


def _moved_or(payload: bytes) -> bytes:
    """``payload``; ``ChannelMoved`` for ``MOVED`` (its shard channel left its node)."""
    if payload is MOVED:
        raise ChannelMoved("the channel moved to another node")
    return payload
