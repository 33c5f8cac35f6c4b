"""Errors a producer can act on, and the one sentence a validation error becomes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from redis.exceptions import AuthenticationError, ConnectionError


# Why a model refuses a suffix (insert mode), after its name.
NO_FIM = ("has no fill-in-the-middle tokens (its tokenizer declares none), so it cannot take a "
          "suffix: leave suffix unset, or serve a model trained for insert mode")


class TokenfleetError(Exception):
    """Base of the fleet's own errors."""


class QueueFull(TokenfleetError):
    """The model's queue holds ``max_queue`` jobs; nothing was enqueued. Retry later."""

    def __init__(self, queue: str, depth: int, limit: int,
                 why: str = "TOKENFLEET_MAX_QUEUE") -> None:
        super().__init__(
            f"queue {queue!r} is full ({depth} jobs waiting or running, limit {limit}, "
            f"{why}); nothing was enqueued: retry later"
        )
        self.queue, self.depth, self.limit, self.why = queue, depth, limit, why


# How a refusal names what a request brought, by the limit's name.
_MEASURED = {"prompt_tokens": "prompt has {} tokens", "new_tokens": "max_new_tokens is {}",
             "payload_bytes": "request is {} bytes as JSON"}


class LimitExceeded(TokenfleetError, ValueError):
    """The request is over a limit of its queue; nothing was enqueued. The
    message names the limit and what sets it: the model ("model length 1024"),
    the queue's workers or this client, by its setting's variable."""

    def __init__(self, name: str, value: int, limit: int, by: str, why: str) -> None:
        measured = _MEASURED.get(name, name + " is {}").format(value)
        super().__init__(f"{measured}; {by} allows {limit} ({why})")
        self.name, self.value, self.limit, self.by, self.why = name, value, limit, by, why


class JobNotFound(TokenfleetError):
    """No record for this job id: never submitted, or expired after its result TTL."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r}: never submitted, or its record expired")
        self.job_id = job_id


class NoWorker(TokenfleetError):
    """No live worker serves the queue, and the submit asked for one (the default);
    nothing was enqueued."""

    def __init__(self, queue: str, served: list[str] | None = None) -> None:
        now = ", ".join(repr(q) for q in served) if served else "none"
        super().__init__(
            f"no live worker serves queue {queue!r} (queues served now: {now}); nothing was "
            f"enqueued: start one with `tokenfleet worker --queue {queue}`, declare it for a pool "
            f"that scales to zero (`tokenfleet queue create {queue}`), or pass "
            "require_worker=False (TOKENFLEET_REQUIRE_WORKER=0) to queue ahead of the workers"
        )
        self.queue, self.served = queue, list(served or [])


class WorkersGone(NoWorker):
    """A queue that was served has had no live worker for longer than the grace
    period (``TOKENFLEET_NO_WORKER_GRACE_S``): its workers may be restarting or
    scaling up, so a later retry may pass; nothing was enqueued. Within the
    grace period its jobs queue instead."""

    def __init__(self, queue: str, served: list[str] | None, gone_for_s: float,
                 grace_s: float) -> None:
        # Not NoWorker's sentence: its advice (start a worker, queue ahead) is
        # for a name never served; this one says to retry.
        TokenfleetError.__init__(
            self, f"no live worker has served queue {queue!r} for {gone_for_s:.0f} s, past the "
            f"grace period of {grace_s:g} s (TOKENFLEET_NO_WORKER_GRACE_S) in which its jobs "
            "wait for its workers to come back; nothing was enqueued: retry later")
        self.queue, self.served = queue, list(served or [])
        self.gone_for_s, self.grace_s = gone_for_s, grace_s


class IdempotencyConflict(TokenfleetError):
    """The idempotency key was already used for a different request; nothing was enqueued.

    The message does not name the other job: its id is read and cancel access.
    """

    def __init__(self, key: str) -> None:
        super().__init__(
            f"idempotency key {key!r} was already used for a different request (another "
            "model, prompt or parameters); nothing was enqueued: use a new key for a new request"
        )
        self.key = key


class QueueNotAllowed(TokenfleetError):
    """The API key may not use this queue (its ``--queues``); nothing was enqueued."""

    def __init__(self, queue: str, allowed: list[str]) -> None:
        super().__init__(f"this API key may not use the model {queue!r} (its queues: "
                         f"{', '.join(allowed) or 'none'}); nothing was enqueued")
        self.queue, self.allowed = queue, allowed


class PriorityNotAllowed(TokenfleetError):
    """The request's priority is above its API key's ``--max-priority``; nothing was enqueued."""

    def __init__(self, priority: str, allowed: str) -> None:
        super().__init__(f"this API key may not send priority {priority!r} (its max priority: "
                         f"{allowed!r}, `tokenfleet keys create --max-priority`); send "
                         f"{allowed!r} or lower; nothing was enqueued")
        self.priority, self.allowed = priority, allowed


class RateLimited(TokenfleetError):
    """The API key used its requests per minute (``rpm``); nothing was enqueued.
    ``retry_after_s``: when the same request would pass."""

    limit_name = "rpm"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


class TokenRateLimited(RateLimited):
    """The API key used its tokens per minute (``tpm``); nothing was enqueued."""

    limit_name = "tpm"


class OverTokenRate(TokenfleetError):
    """One request asks more tokens than the key's ``tpm`` allows in a minute:
    it can never pass as it is."""

    def __init__(self, tokens: int, tpm: int) -> None:
        super().__init__(
            f"this request counts {tokens} tokens (its prompt and max_tokens), more than the "
            f"API key's limit of {tpm} tokens per minute (tpm): lower max_tokens or the prompt")
        self.tokens, self.tpm = tokens, tpm


class TenantQueueFull(RateLimited):
    """The tenant has its key's ``max_queued`` jobs waiting or running."""

    limit_name = "max_queued"

    def __init__(self, tenant: str, jobs: int, cap: int) -> None:
        super().__init__(
            f"tenant {tenant!r} has {jobs} jobs waiting or running, the API key's limit "
            f"(max_queued {cap}); nothing was enqueued: retry when some have ended", 1.0)
        self.tenant, self.jobs, self.cap = tenant, jobs, cap


class InvalidRequest(TokenfleetError, ValueError):
    """The request breaks a rule (a field's type, range or limit); nothing was enqueued.

    The message is one line naming the field and the limit; ``errors`` lists every
    problem JSON-ready (``{"loc": [...], "msg": ..., "type": ...}``, the input
    left out: it can be a whole prompt), for a web backend to return as it is. A
    ``ValueError`` too, as pydantic's ``ValidationError`` it replaces is.
    """

    def __init__(self, message: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.errors = list(errors or [])

    @classmethod
    def from_validation(cls, exc: ValidationError) -> InvalidRequest:
        errors = [{"loc": list(error["loc"]), "msg": error["msg"], "type": error["type"]}
                  for error in exc.errors(include_url=False, include_input=False,
                                          include_context=False)]
        return cls(invalid_input(exc), errors)


class PromptTooLong(LimitExceeded):
    """The prompt has more tokens of the queue's model than the strictest limit
    (the model's length, the workers' or this client's setting); nothing was
    enqueued. Counted where the model's tokenizer is on the submitting machine
    (or given as ``submit(prompt_tokens=)``); else the worker refuses the job."""

    def __init__(self, count: int, limit: int, by: str, why: str) -> None:
        super().__init__("prompt_tokens", count, limit, by, why)
        self.count = count


class RedisUnavailable(TokenfleetError, ConnectionError):
    """The first connection to Redis failed: nothing to ride out, so not retried.

    A ``redis.exceptions.ConnectionError`` too, so code that catches those keeps working.
    """

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(f"cannot connect to Redis at {url}: {cause} "
                         "(check TOKENFLEET_REDIS_URL and that redis-server runs there)")
        self.url = url


class RedisBusy(TokenfleetError, ConnectionError):
    """Every Redis connection this client may hold stayed in use for the whole
    wait: Redis is up, the fleet is busy. Retry later.

    A ``redis.exceptions.ConnectionError`` too, so code that backs off and tries
    again on those (a subscription's keeper) does so here.
    """

    def __init__(self, connections: int, wait_s: float) -> None:
        super().__init__(
            f"the fleet is busy: all {connections} Redis connections of this gateway stayed in "
            f"use for {wait_s:g} s; retry later, or raise TOKENFLEET_GATEWAY_REDIS_CONNECTIONS"
        )
        self.connections, self.wait_s = connections, wait_s


class RedisAuthFailed(TokenfleetError, AuthenticationError):
    """Redis refused the credentials of the URL; never retried (they will not change)."""

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(f"Redis at {url} refused the credentials: {cause} "
                         "(check the user and password in TOKENFLEET_REDIS_URL)")
        self.url = url


# The longest part of a field's location named in an error (a mapping's key can
# be the client's to choose, and long).
MAX_NAMED = 40


def invalid_field(exc: ValidationError,
                  names: Mapping[tuple[str, ...], str] | None = None) -> str | None:
    """The field of ``exc``'s first error: its name in ``names`` when given (a
    field as the caller knows it), else its location dotted (``messages[0].role``);
    None for an error of the whole input."""
    loc = tuple(str(part) for part in exc.errors(include_url=False)[0]["loc"])
    if names is not None:
        return names.get(loc)
    if loc[-1:] == ("[key]",):  # a mapping's key: named by its mapping, never echoed
        loc = loc[:-2]
    dotted = ""
    for part in loc:
        index = part.isdigit()
        part = part if len(part) <= MAX_NAMED else f"{part[:MAX_NAMED]}..."
        dotted += f"[{part}]" if index else (f".{part}" if dotted else part)
    return dotted or None



def invalid_input(exc: ValidationError,
                  names: Mapping[tuple[str, ...], str] | None = None) -> str:
    """``exc`` as the one line a user sees: the field, what was wrong with it and
    the limit it broke (as the validator states them), and how many more errors
    there are. ``names`` is as for :func:`invalid_field`. The input itself is
    left out: it can be a whole prompt."""
    first = exc.errors(include_url=False)[0]
    field = invalid_field(exc, names)
    what = first["msg"].removeprefix("Value error, ")
    if tuple(first["loc"][-1:]) == ("[key]",):
        what = f"a key: {what}"
    if first["type"] == "json_invalid":
        line = f"not valid JSON ({what})"
    elif first["type"] == "extra_forbidden":
        line = f"unrecognized request argument '{field}'"
    elif field:
        line = f"invalid '{field}': {what}"
    else:
        line = what
    more = exc.error_count() - 1
    return line + (f" (and {more} more error{'s' * (more > 1)})" if more else "")
