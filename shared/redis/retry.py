"""The retry rule of every Redis client the fleet makes, sync and asyncio alike.

Commands are retried with exponential backoff on connection errors and timeouts
once the client has been connected, so a producer or worker waits for a
restarted Redis instead of dying. Before the first successful connection nothing
is retried: a wrong host or port, or a Redis that is not up, is one clear error
(``RedisUnavailable``) within the connect timeout, not 13 s of backoff and a
traceback. Refused credentials (``RedisAuthFailed``) and missing permissions are
never retried: they do not change by waiting.

The loops are redis-py's own (``Retry.call_with_retry``); :class:`FailFast`
decides, for both, what a failure means. A connection's handshake (AUTH, HELLO)
runs inside that loop from redis-py 7.2 on, the floor in ``pyproject.toml``:
before, a refused password escaped it untranslated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, ConnectionError, TimeoutError
from redis.retry import Retry

from tokenfleet.shared.wire.errors import RedisAuthFailed, RedisUnavailable, TokenfleetError
from tokenfleet.shared.redis.url import redacted

T = TypeVar("T")

# Ten retries with a backoff capped at 2 s ride out a restart of ~15 s.
RETRIES = 10
# What a retry rides out: a connection lost or refused, a reply that timed out.
RETRIED = (ConnectionError, TimeoutError)


def backoff() -> ExponentialBackoff:
    """The pause before each retry: 0.1 s, doubling, at most 2 s."""
    return ExponentialBackoff(cap=2.0, base=0.05)


class FailFast:
    """Whether a client has ever reached Redis, and so whether a failure is
    ridden out or raised at once.

    redis-py deep-copies a client's retry policy into each of its connections;
    every copy keeps this one object, so one success counts for all of them.
    """

    def __init__(self, url: str) -> None:
        self.url = redacted(url)  # for the errors: never the password
        self.up = False

    def __deepcopy__(self, memo: dict[int, Any]) -> FailFast:
        return self  # shared by design: see the class docstring

    def succeeded(self) -> None:
        self.up = True

    def final(self, error: Exception) -> Exception | None:
        """The error to raise at once instead of retrying ``error``, or None to retry."""
        if isinstance(error, TokenfleetError | AuthorizationError):
            return error  # already explained (a nested retry), or a missing ACL permission
        if isinstance(error, AuthenticationError):
            return RedisAuthFailed(self.url, error)
        if not self.up:
            return RedisUnavailable(self.url, error)
        return None

    def raise_final(self, error: Exception) -> None:
        """Raise :meth:`final`'s error, if any, caused by ``error``."""
        now = self.final(error)
        if now is not None:
            raise now from (None if now is error else error)


class FailFastRetry(Retry):
    """redis-py's retry, except as :class:`FailFast` says."""

    def __init__(self, rule: FailFast) -> None:
        super().__init__(backoff(), RETRIES, RETRIED)
        self.rule = rule

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any],
                        *args: Any, **kwargs: Any) -> T:
        def tracked() -> T:
            result = do()
            self.rule.succeeded()
            return result

        def failed(error: Exception, *failures: int) -> None:
            fail(error, *failures)
            self.rule.raise_final(error)

        return super().call_with_retry(tracked, failed, *args, **kwargs)


class AsyncFailFastRetry(AsyncRetry):
    """:class:`FailFastRetry` for redis-py's asyncio clients."""

    def __init__(self, rule: FailFast) -> None:
        super().__init__(backoff(), RETRIES, RETRIED)
        self.rule = rule

    async def call_with_retry(self, do: Callable[[], Awaitable[T]],
                              fail: Callable[..., Awaitable[Any]],
                              *args: Any, **kwargs: Any) -> T:
        async def tracked() -> T:
            result = await do()
            self.rule.succeeded()
            return result

        async def failed(error: Exception, *failures: int) -> None:
            await fail(error, *failures)
            self.rule.raise_final(error)

        return await super().call_with_retry(tracked, failed, *args, **kwargs)
