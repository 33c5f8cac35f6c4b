"""The blocking client, for scripts and synchronous web backends."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, Literal, TypeVar, overload

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from tokenfleet.client import batches as batch_client
from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.client.batches import Request as BatchRequest
from tokenfleet.client.batch_records import Batch
from tokenfleet.client.choices import check_n, choice_requests
from tokenfleet.client.generation import Generation
from tokenfleet.client.prompt_tokens import count_prompt_tokens, worth_counting
from tokenfleet.client.pubsub_pool import PubSubPool
from tokenfleet.client.served import served_now
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
    is_end,
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
from tokenfleet.shared.file_store import open_store
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.redis.liveness import live_since
from tokenfleet.shared.redis.connect import connect, resubscribe_after
from tokenfleet.shared.wire.schemas import EndEvent, GenerationRequest, JobState, JobStatus, TokenEvent
from tokenfleet.shared.settings import Settings, get_settings

T = TypeVar("T")


class FleetClient:
    """Submit jobs to the fleet and follow them.

    ``FleetClient()`` reads ``TOKENFLEET_REDIS_URL``; pass a URL to override it.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        # redis-py types replies as bytes | str; with decode_responses off they are bytes.
        self._url = url
        self.redis: Any = connect(url or self.settings.redis_url)
        self.keys = Keys.for_url(namespace or self.settings.namespace, url or self.settings.redis_url)
        # Kept from one wait() or stream() to the next.
        self._pubsubs = PubSubPool(self.redis, sharded=self.keys.sharded)
        # Deadlines and liveness are judged on Redis's clock, not this host's.
        self.clock = FleetClock()
        self._tenants = KnownTenants()  # of each queue, for submit's depth
        self._partitions = QueuePartitions()  # of each queue, where a job goes
        self._grammars = GrammarCheck()  # whether a structured output compiles
        # The batch calls' event loop and asyncio client (``_async``), made when first used.
        self._runner: asyncio.Runner | None = None
        self._aio: AsyncFleetClient | None = None
        self._runner_lock = threading.Lock()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._runner_lock:
            if self._runner is not None:
                if self._aio is not None:
                    self._runner.run(self._aio.close())
                self._runner.close()
                self._runner = self._aio = None
        self._pubsubs.close()
        self.redis.close()
        self._grammars.close()

    def submit(self, prompt: str | GenerationRequest | None = None, /, *,
               require_worker: bool | None = None, prompt_tokens: int | None = None,
               tenant: str | None = None, **kwargs: Any) -> str:
        """Validate, then enqueue atomically; returns the job id.

        Keyword arguments are the fields of ``SamplingParams`` and of
        ``GenerationRequest``. Raises ``InvalidRequest`` for bad input
        (nothing is written), ``QueueFull`` when the model's queue is full,
        ``IdempotencyConflict`` when the ``idempotency_key`` was used for another
        request (the same request again returns the first job's id), and
        ``NoWorker`` when no live worker serves the queue. A queue whose last
        worker was live within ``TOKENFLEET_NO_WORKER_GRACE_S`` (a restart of
        its only worker) queues the job all the same; past that grace, its
        ``NoWorker`` is a ``WorkersGone`` (retry later). To queue ahead of the
        workers (they start later) pass ``require_worker=False`` or set
        ``TOKENFLEET_REQUIRE_WORKER=0``; give such jobs a ``deadline_s``.

        The queue's limits (prompt tokens, ``max_new_tokens``, payload, queue
        length) are the strictest of what its live workers publish and this
        client's own settings; with no live worker, this client's alone. A
        request over one raises ``LimitExceeded`` (``PromptTooLong`` for the
        prompt), naming the limit and what sets it (``model length 1024``). The
        prompt's tokens are counted here where the queue's model is on this
        machine (``tokenfleet.client.prompt_tokens``), or given as ``prompt_tokens``;
        else the worker counts them (and fails an over-long job).

        ``tenant`` names whose job it is (``InvalidRequest`` naming ``tenant``
        unless 1 to 64 letters, digits, '.', '_' or '-', starting with a letter
        or digit; none: the tenant "default"): workers share the fleet fairly
        among tenants with queued work, by tokens served, and the job is visible
        through the gateway to that tenant's keys only.

        ``webhook_url`` (an http:// or https:// URL) has the job's end posted
        there, signed, as ``job.completed``, ``job.failed``, ``job.cancelled``
        or ``job.expired`` (docs/webhooks.md).
        """
        request = build_request(prompt, kwargs, self.settings, tenant)
        if request.structured_output is not None:  # within TOKENFLEET_GRAMMAR_COMPILE_S
            refuse_uncompilable(self._grammars.problem(request.structured_output,
                                                       self.settings.grammar_compile_s))
        if prompt_tokens is None:
            prompt_tokens = self._count_prompt_tokens(request)
        now = self.clock.read(self.redis)
        while True:  # again only when a tenant new to this client queued meanwhile
            sub = submission(request, self.keys, self.settings,
                             require_worker_for(require_worker, self.settings),
                             now, prompt_tokens, self._tenants.of(request.model),
                             self.partitions(request.model), self._partitions.turn())
            result = sub.call.run(self.redis)
            if not self._tenants.heard(request.model, result):
                break
        job_id = submitted_id(result, request, self.settings)
        if job_id is None:
            raise no_worker(request, result, self.served_queues(), now, self.settings)
        return job_id

    def submit_choices(self, prompt: str | GenerationRequest | None = None, /, *, n: int,
                       require_worker: bool | None = None, **kwargs: Any) -> list[str]:
        """Submit one request as ``n`` choices (``tokenfleet.client.choices``); returns
        their job ids, choice 0 first. Each is a job of its own (``wait``,
        ``stream``, ``cancel`` take it); with a ``seed``, choice i is the single
        request ``submit(..., seed=seed, choice_index=i)``. ``n`` above
        ``TOKENFLEET_MAX_N`` is an ``InvalidRequest``. Should a choice be
        refused (``QueueFull``...), those submitted before it are cancelled and
        the error raised: the request is queued whole or not at all."""
        check_n(n, self.settings)
        request = build_request(prompt, kwargs, self.settings)
        job_ids: list[str] = []
        try:
            for choice in choice_requests(request, n):
                job_ids.append(self.submit(choice, require_worker=require_worker))
        except BaseException:
            for job_id in job_ids:
                with contextlib.suppress(TokenfleetError, RedisError):
                    self.cancel(job_id, timeout=0)
            raise
        return job_ids

    def generation(self, prompt: str | GenerationRequest | None = None, /, *,
                   require_worker: bool | None = None, **kwargs: Any) -> Generation:
        """``with client.generation(prompt, ...) as gen: for event in gen: ...``: the
        job is submitted on entering the block (as ``submit``) and cancelled if the
        block is left before it ended; ``gen.end`` is its ``EndEvent``."""
        return Generation(self, lambda: self.submit(prompt, require_worker=require_worker,
                                                     **kwargs))

    def _count_prompt_tokens(self, request: GenerationRequest) -> int | None:
        # As the asyncio client counts: in the model the queue's live workers load.
        if not worth_counting(request, self.settings):
            return None
        queue = served_now(self, request.model)
        return None if queue is None else count_prompt_tokens(request, queue.models)

    def submit_batch(self, requests: Iterable[BatchRequest], *, endpoint: str | None = None,
                     completion_window: str = "24h", metadata: dict[str, str] | None = None,
                     tenant: str | None = None) -> Batch:
        """See ``AsyncFleetClient.submit_batch`` (not from inside an event loop)."""
        return self._async(lambda c: batch_client.submit_batch(
            c, requests, endpoint=endpoint, completion_window=completion_window,
            metadata=metadata, tenant=tenant))

    def batch(self, batch_id: str, *, tenant: str | None = None) -> Batch:
        """The batch (``KeyError`` when there is none of the tenant's)."""
        return self._async(lambda c: batch_client.batch(c, batch_id, tenant))

    def cancel_batch(self, batch_id: str, *, tenant: str | None = None) -> Batch:
        """Ask for the batch to be cancelled: finished lines are kept."""
        return self._async(lambda c: batch_client.cancel(c, batch_id, tenant))

    def batch_results(self, batch_id: str, order: Literal["input", "finished"] = "finished",
                      *, tenant: str | None = None) -> Iterator[dict[str, Any]]:
        """The ended batch's result lines: output, then errors, streamed; or in input
        order (held in memory to sort them: about the size of the result files)."""
        found = self.batch(batch_id, tenant=tenant)
        return batch_client.results(open_store(self.settings.files_url), found, order)

    def _async(self, work: Callable[[AsyncFleetClient], Coroutine[Any, Any, T]]) -> T:
        """``work`` on an asyncio client of the same fleet, on this client's own
        event loop (made at the first call, kept until ``close()``): the batch
        records and the store's streaming have one implementation."""
        with self._runner_lock:  # one loop runs one call at a time: threads take turns
            if self._runner is None:
                self._runner = asyncio.Runner()
            if self._aio is None:
                self._aio = self._runner.run(self._open_aio())
            return self._runner.run(work(self._aio))

    async def _open_aio(self) -> AsyncFleetClient:
        return AsyncFleetClient(self._url, settings=self.settings, namespace=self.keys.namespace)

    def partitions(self, model: str) -> int:
        """How many partitions queue ``model`` has (1: the queue itself), cached
        for a few seconds (``tokenfleet queue create --partitions``)."""
        count = self._partitions.cached(model)
        if count is None:
            count = self._partitions.heard(model, self.redis.get(self.keys.partitions(model)))
        return count

    def served_queues(self) -> list[str]:
        """The queues at least one live worker serves now."""
        names = list(self.redis.scan_iter(match=self.keys.served_pattern(), count=500))
        pipe = self.redis.pipeline(transaction=False)
        since = live_since(self.clock.read(self.redis))
        for name in names:
            pipe.zcount(name, since, "+inf")
        return served_queues(names, pipe.execute() if names else [], self.keys)

    def status(self, job_id: str) -> JobState:
        """The job's stored state, read once; never blocks, writes nothing.

        A job still queued past its deadline can no longer start: it reads as
        ``expired`` (finish reason ``deadline``) though its record still says
        queued, with no live worker as with one. The worker that reads its
        entry ends the record; for a queue no worker serves,
        ``tokenfleet.client.fleet.repair_fleet`` does.
        """
        return as_read(parse_state(job_id, self.redis.hgetall(self.keys.job(job_id))),
                       self.clock.read(self.redis))

    def cancel(self, job_id: str, timeout: float = CANCEL_WAIT_S) -> bool:
        """Cancel a job; True only if it ended ``cancelled``.

        A queued job ends at once. A running job's worker is told to stop it
        before its next step, but the job may still end otherwise first (it
        finishes, fails or expires): this waits up to ``timeout`` seconds for the
        job to end and returns True only if it ended cancelled. False: it had
        ended already, it ended otherwise, or it was still running after
        ``timeout`` (the request stands; ``status`` tells how it ends).
        ``timeout=0`` asks and returns at once.
        """
        # The queue's key goes to the script with the others (declared keys only).
        record = self.redis.hmget(self.keys.job(job_id), CANCEL_FIELDS)
        if record[0] is None:
            raise JobNotFound(job_id)
        call = cancel_call(job_id, record, self.keys, self.settings, self.clock.read(self.redis))
        verdict = cancel_verdict(call.run(self.redis), job_id)
        if verdict is not CancelVerdict.REQUESTED:
            return verdict is CancelVerdict.CANCELLED
        if timeout <= 0:
            return False  # asked; the worker stops it at its next step
        try:
            return self.wait(job_id, timeout=timeout).status is JobStatus.CANCELLED
        except TimeoutError:
            return False

    def wait(self, job_id: str, timeout: float | None = None) -> JobState:
        """Block until the job ends; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failures = 0
        while True:
            try:
                return self._wait(job_id, deadline)
            except RedisConnectionError:
                failures += 1
                if not resubscribe_after(self.redis, failures):
                    raise

    def _wait(self, job_id: str, deadline: float | None) -> JobState:
        # The end channel: a waiter hears one message, not one per token.
        with self._pubsubs.subscribed(self.keys.ends(job_id)) as pubsub:
            while True:
                state = self.status(job_id)
                if state.status.is_terminal:
                    return state
                # Listen until the end message or a quiet interval (or a queued
                # job's deadline), then read the record again.
                wake = expires_at(state)
                while True:
                    message = pubsub.get_message(timeout=time_slice(deadline, wake,
                                                                     self.clock.now()))
                    if message is None or is_end(message):
                        break
                check_deadline(deadline, job_id)

    @overload
    def stream(self, job_id: str, timeout: float | None = None, *,
               final: Literal[False] = False) -> Iterator[TokenEvent]: ...
    @overload
    def stream(self, job_id: str, timeout: float | None = None, *,
               final: Literal[True]) -> Iterator[TokenEvent | EndEvent]: ...

    def stream(self, job_id: str, timeout: float | None = None, *,
               final: bool = False) -> Iterator[TokenEvent | EndEvent]:
        """Yield the job's token events in order, from its first token to its end;
        with ``final=True`` the last item is the job's ``EndEvent`` (its status,
        finish reason and error), so no second ``status()`` is needed.

        Works whenever it starts: what was generated before is replayed from the
        job's token log, the rest arrives live, with no gap and no duplicate.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor = EventCursor()
        failures = 0
        while not cursor.ended:
            try:
                # Subscribed again (a cluster node lost), it goes on from the cursor.
                yield from self._follow(job_id, cursor, deadline)
            except RedisConnectionError:
                failures += 1
                if not resubscribe_after(self.redis, failures):
                    raise
        if final:
            assert cursor.final is not None  # set whenever the cursor ends
            yield cursor.final

    def _follow(self, job_id: str, cursor: EventCursor,
                deadline: float | None) -> Iterator[TokenEvent]:
        with self._pubsubs.subscribed(self.keys.events(job_id)) as pubsub:
            self._catch_up(job_id, cursor)
            yield from cursor.take()
            while not cursor.ended:
                message = pubsub.get_message(timeout=time_slice(deadline, cursor.expires_at,
                                                                 self.clock.now()))
                if not cursor.feed_message(message):
                    self._catch_up(job_id, cursor)
                yield from cursor.take()
                if not cursor.ended:
                    check_deadline(deadline, job_id)

    def _catch_up(self, job_id: str, cursor: EventCursor) -> None:
        """Read the token log past the cursor; end it if the record says so."""
        cursor.feed_log(self.redis.xrange(self.keys.out(job_id), cursor.log_after(), "+"))
        if cursor.ended:
            return
        state = self.status(job_id)  # raises JobNotFound; an overdue job reads as expired
        cursor.expires_at = expires_at(state)
        if state.status.is_terminal:
            # Ended between the two reads: the log now holds every token.
            cursor.feed_log(self.redis.xrange(self.keys.out(job_id), cursor.log_after(), "+"))
            cursor.end_from(state)

