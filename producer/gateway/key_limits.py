"""An API key's limits, applied where a job is submitted through the gateway:
the queues it may use, its requests and tokens per minute, and its tenant's
jobs waiting or running.

Every count lives in Redis (``gateway_scripts``), so every gateway of a fleet
spends one budget. Tokens are charged at admission as the prompt plus
``max_new_tokens``, the prompt never under its real count: counted by the
model's tokenizer where this gateway has it, else bounded from above by its
bytes (``prompt_tokens.charged_prompt_tokens``); when the job ends, this gateway
corrects the charge to the prompt's tokens and the tokens made, and takes the
job off its tenant's count (``tokenfleet.gateway.settlement``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from fastapi import Request
from redis.exceptions import RedisError
from starlette.types import Scope

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.gateway.auth import caller
from tokenfleet.client.choices import choice_requests
from tokenfleet.client.prompt_tokens import charged_prompt_tokens
from tokenfleet.client.served import served
from tokenfleet.gateway.settlement import Charge, Settlement
from tokenfleet.shared.wire import gateway_scripts
from tokenfleet.shared.wire.errors import (InvalidRequest, OverTokenRate, PriorityNotAllowed,
                                      QueueNotAllowed, RateLimited, TenantQueueFull,
                                      TokenRateLimited)
from tokenfleet.shared.wire.keys import PRIORITIES
from tokenfleet.shared.wire.gateway_scripts import RateState, RateVerdict
from tokenfleet.shared.wire.schemas import ApiKey, GenerationRequest, JobStatus

# The routes that submit a job: they count a request (and its tokens); the
# others only report the key's state in their headers.
SUBMITTING = frozenset({"/v1/jobs", "/v1/completions", "/v1/chat/completions"})
# A reservation older than this belongs to a submit that never finished (its
# gateway died in between): a later admission at the cap drops it.
RESERVATION_S = 60.0
# How long the models a queue's workers load are kept, to find their tokenizer.
MODELS_CACHE_S = 5.0


def duration(seconds: float) -> str:
    """A time as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``20ms``,
    ``1s``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


def rate_headers(key: ApiKey, state: RateState) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for the limits the key has."""
    headers: dict[str, str] = {}
    if key.rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(key.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, key.rpm - state.requests))
        headers["x-ratelimit-reset-requests"] = duration(state.requests_reset_s)
    if key.tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(key.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, key.tpm - state.tokens))
        headers["x-ratelimit-reset-tokens"] = duration(state.tokens_reset_s)
    return headers


async def submit_as_caller(request: Request, client: AsyncFleetClient,
                           jobs: list[GenerationRequest], n: int = 1) -> list[str]:
    """Submit the ``n`` choices of each of ``jobs`` (a request's prompts), in
    order, for the request's caller: through the app's ``KeyLimits`` where it has
    one (the gateway), else as they are; all queued, or none left running. Each
    choice is a job: it counts as a request and its tokens against the key."""
    choices = [choice for job in jobs for choice in choice_requests(job, n)]
    limits: KeyLimits | None = getattr(request.app.state, "limits", None)
    if limits is None:
        return await client.submit_whole(choices, client.submit)
    keyed: KeyLimits = limits
    key = caller(request.state)
    if key is not None and key.rpm is not None and n > key.rpm:
        # It could never pass: told so before any choice is counted or queued,
        # not with a 429 that asks to retry, each try queueing and cancelling jobs.
        raise InvalidRequest(f"invalid 'n': {n} choices are {n} requests, more than this API "
                             f"key's rpm of {key.rpm} allows in any minute; ask for n of "
                             f"{key.rpm} or fewer")

    async def submit(choice: GenerationRequest) -> str:
        return await keyed.submit(request, choice)
    return await client.submit_whole(choices, submit)


class KeyLimits:
    """One gateway's side of the keys' limits (one per app, closed at shutdown)."""

    def __init__(self, client: AsyncFleetClient, *, tenant_by_body: bool = False) -> None:
        # ``tenant_by_body``: a request without a key may name its job's tenant
        # (``off``: a private network's backends do). Elsewhere it may not: on an
        # ``auto`` gateway not yet closed, anyone could plant jobs under a tenant
        # whose key is made later, and that tenant would read them as its own.
        self.client, self.tenant_by_body = client, tenant_by_body
        self.settlement = Settlement(client)
        self._models: dict[str, tuple[float, list[str]]] = {}

    def peek(self, scope: Scope, key: ApiKey) -> Coroutine[Any, Any, None] | None:
        """The read of the key's headers for a request that submits nothing
        (counted nowhere); None for one that submits: ``submit`` counts it and
        sets them, and no task is made for nothing on the submit's path."""
        if scope["method"] == "POST" and scope["path"] in SUBMITTING:
            return None
        return self._peek(scope, key)

    async def _peek(self, scope: Scope, key: ApiKey) -> None:
        state = await self._take(key, "-", requests=0, tokens=0)
        scope.setdefault("state", {})["rate_headers"] = rate_headers(key, state)

    async def submit(self, request: Request, job: GenerationRequest) -> str:
        """Submit ``job`` as the request's key allows, as its tenant's job."""
        key = caller(request.state)
        if key is None:
            if job.tenant is not None and not self.tenant_by_body:
                raise InvalidRequest(
                    f"invalid 'tenant': {job.tenant!r}: only an API key sets a job's tenant on "
                    "this gateway (its jobs without a key are the tenant 'default'); leave "
                    "it out, or send a key of that tenant")
            return await self.client.submit(job)
        if job.tenant is not None and job.tenant != key.tenant:
            raise InvalidRequest(f"invalid 'tenant': {job.tenant!r} is not this API key's "
                                 "tenant; leave it out: the key sets it")
        job = job.model_copy(update={"tenant": key.tenant})
        if key.queues is not None and job.model not in key.queues:
            raise QueueNotAllowed(job.model, key.queues)
        if PRIORITIES.index(job.priority) < PRIORITIES.index(key.max_priority):
            # Refused, not lowered: a caller that asked for a level is told it
            # did not get it, rather than finding out from its latency.
            raise PriorityNotAllowed(job.priority, key.max_priority)
        request_id = uuid.uuid4().hex
        tokens = await self._tokens(job, key.tpm) if key.tpm is not None else 0
        if key.limited:
            state = await self._take(key, request_id, requests=1, tokens=tokens)
            request.state.rate_headers = rate_headers(key, state)
            _refuse(key, state, tokens)
        try:
            reservation = (await self._reserve(key.tenant, key.max_queued)
                           if key.max_queued is not None else None)
        except TenantQueueFull:
            # Refused: its tokens are given back, as below (the request stays counted).
            with contextlib.suppress(RedisError, OSError):
                await self._undo(key, request_id, tokens, None)
            raise
        try:
            job_id = await self.client.submit(job)
        except Exception:
            # Nothing was enqueued: the tokens and the place are given back
            # (the request itself stays counted, as OpenAI counts refused ones).
            with contextlib.suppress(RedisError, OSError):
                await self._undo(key, request_id, tokens, reservation)
            raise
        if reservation is not None:
            # The job takes the reservation's place: added first, so the count
            # never dips below the jobs there are. One round trip: a pipeline
            # on one connection runs its commands in order.
            jobs = self.client.keys.tenant_jobs(key.tenant)
            pipe = self.client.redis.pipeline(transaction=False)
            pipe.zadd(jobs, {job_id: await self._now()})
            pipe.zrem(jobs, reservation)
            await pipe.execute()
        if tokens or reservation is not None:
            self.settlement.watch(job_id, Charge(
                key_id=key.key_id, tenant=key.tenant, request_id=request_id, tokens=tokens,
                max_new_tokens=job.sampling.max_new_tokens, counted=reservation is not None))
        return job_id

    async def _tokens(self, job: GenerationRequest, tpm: int) -> int:
        """The job's charge at admission: its prompt, never under its real count,
        plus its ``max_new_tokens``. A bound (not an exact count) over ``tpm``
        is charged ``tpm``, so it passes once the window is empty instead of
        never; the job then settles at what it used, past ``tpm`` if it must.
        One that asks more new tokens than ``tpm`` alone never passes."""
        models = await self._queue_models(job.model)
        # Tokenizing a prompt of up to max_payload_bytes takes a while: off the loop.
        prompt, exact = await asyncio.to_thread(charged_prompt_tokens, job, models)
        tokens = prompt + job.sampling.max_new_tokens
        return tokens if exact else min(tokens, max(tpm, job.sampling.max_new_tokens + 1))

    async def _queue_models(self, queue: str) -> list[str]:
        """The models the queue's live workers load (kept ``MODELS_CACHE_S``)."""
        now = time.monotonic()
        cached = self._models.get(queue)
        if cached is not None and cached[0] > now:
            return cached[1]
        found = await served(self.client, queue)
        models = found.models if found is not None else []
        if len(self._models) > 1_000:  # queues made up by callers: start over
            self._models.clear()
        self._models[queue] = (now + MODELS_CACHE_S, models)
        return models

    async def close(self) -> None:
        """Stop settling (the jobs still open keep their charges: see ``settlement``)."""
        await self.settlement.close()

    async def _now(self) -> float:
        return await self.client.clock.aread(self.client.redis)

    async def _take(self, key: ApiKey, request_id: str, *, requests: int,
                    tokens: int) -> RateState:
        call = gateway_scripts.rate_take(
            self.client.keys, key_id=key.key_id, request_id=request_id, now=await self._now(),
            rpm=key.rpm, tpm=key.tpm, requests=requests, tokens=tokens)
        return await call.run_async(self.client.redis)

    async def _reserve(self, tenant: str, cap: int) -> str:
        """A place among the tenant's jobs, or ``TenantQueueFull``; at the cap,
        ended jobs and stale reservations are dropped first and it tries again."""
        reservation = f"reserved:{uuid.uuid4().hex}"
        for attempt in range(2):
            admitted = await gateway_scripts.tenant_admit(
                self.client.keys, tenant=tenant, cap=cap, reservation=reservation,
                now=await self._now()).run_async(self.client.redis)
            if admitted.reserved:
                return reservation
            if attempt == 0:
                # Tried again even if nothing was dropped here: the settlement
                # may have taken an ended job off since the count was read.
                await self._prune(tenant)
        raise TenantQueueFull(tenant, admitted.jobs, cap)

    async def _prune(self, tenant: str) -> None:
        """Drop ended jobs and stale reservations from a tenant's count."""
        redis, keys = self.client.redis, self.client.keys
        members = await redis.zrange(keys.tenant_jobs(tenant), 0, -1, withscores=True)
        stale_before = await self._now() - RESERVATION_S
        names = [m.decode() for m, _ in members]
        job_ids = [n for n in names if not n.startswith("reserved:")]
        pipe = redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "status")
        statuses = await pipe.execute() if job_ids else []
        gone = [j for j, s in zip(job_ids, statuses)
                if s is None or JobStatus(s.decode()).is_terminal]
        gone += [n for n, (_, at) in zip(names, members)
                 if n.startswith("reserved:") and at < stale_before]
        if gone:
            await redis.zrem(keys.tenant_jobs(tenant), *gone)

    async def _undo(self, key: ApiKey, request_id: str, tokens: int,
                    reservation: str | None) -> None:
        if reservation is not None:
            await self.client.redis.zrem(self.client.keys.tenant_jobs(key.tenant), reservation)
        if tokens:
            await gateway_scripts.rate_settle(
                self.client.keys, key_id=key.key_id, request_id=request_id, charged=tokens,
                used=0).run_async(self.client.redis)


def _refuse(key: ApiKey, state: RateState, tokens: int) -> None:
    """Raise the refusal ``rate_take.lua`` decided, if any."""
    retry = state.retry_after_s
    if state.verdict is RateVerdict.REQUESTS:
        raise RateLimited(
            f"rate limit reached for requests: {state.requests} in the last minute, limit "
            f"{key.rpm} (rpm); retry after {math.ceil(retry)} s (Retry-After)", retry)
    if state.verdict is RateVerdict.TOKENS:
        raise TokenRateLimited(
            f"rate limit reached for tokens: {state.tokens} used in the last minute, this "
            f"request {tokens}, limit {key.tpm} (tpm); retry after {math.ceil(retry)} s "
            "(Retry-After)", retry)
    if state.verdict is RateVerdict.OVERSIZE:
        raise OverTokenRate(tokens, key.tpm or 0)
