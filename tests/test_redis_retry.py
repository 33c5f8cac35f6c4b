"""The one retry rule of the fleet's Redis clients, on redis-py's own sync and
asyncio retry loops, without a server."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from redis.exceptions import AuthenticationError, AuthorizationError, ConnectionError

from tokenfleet.shared.wire.errors import RedisAuthFailed, RedisUnavailable
from tokenfleet.shared.redis.retry import AsyncFailFastRetry, FailFast, FailFastRetry

URL = "redis://app:s3cret@cache:6379/0"


def flaky(errors: list[Exception]) -> tuple[Callable[[], str], list[int]]:
    """A command that raises ``errors`` one per call, then answers; and its call count."""
    calls = [0]

    def do() -> str:
        calls[0] += 1
        if errors:
            raise errors.pop(0)
        return "PONG"

    return do, calls


def ignore(error: Exception, *failures: int) -> None:
    pass


def test_every_copy_of_a_retry_shares_one_rule() -> None:
    retry = FailFastRetry(FailFast(URL))
    assert copy.deepcopy(retry).rule is retry.rule


def test_a_client_never_up_fails_at_once_naming_the_url_without_its_password() -> None:
    do, calls = flaky([ConnectionError("refused")])
    with pytest.raises(RedisUnavailable, match=r"app:\*\*\*@cache") as info:
        FailFastRetry(FailFast(URL)).call_with_retry(do, ignore)
    assert calls == [1] and "s3cret" not in str(info.value)


def test_a_client_once_up_rides_out_lost_connections() -> None:
    retry = FailFastRetry(FailFast(URL))
    assert retry.call_with_retry(flaky([])[0], ignore) == "PONG"
    do, calls = flaky([ConnectionError("lost"), ConnectionError("lost")])
    assert retry.call_with_retry(do, ignore) == "PONG"
    assert calls == [3]


@pytest.mark.parametrize(("error", "raised"), [
    (AuthenticationError("wrong password"), RedisAuthFailed),
    (AuthorizationError("no permission"), AuthorizationError),
])
def test_refused_credentials_are_never_retried(error: Exception, raised: type[Exception]) -> None:
    rule = FailFast(URL)
    rule.succeeded()
    do, calls = flaky([error])
    with pytest.raises(raised):
        FailFastRetry(rule).call_with_retry(do, ignore)
    assert calls == [1]


async def test_the_asyncio_retry_follows_the_same_rule() -> None:
    retry = AsyncFailFastRetry(FailFast(URL))
    sync_do, calls = flaky([ConnectionError("refused")])

    async def do() -> str:
        return sync_do()

    async def fail(error: Exception, *failures: int) -> Any:
        pass

    with pytest.raises(RedisUnavailable):
        await retry.call_with_retry(do, fail)
    retry.rule.succeeded()
    sync_do, calls = flaky([ConnectionError("lost")])
    assert await retry.call_with_retry(do, fail) == "PONG"
    assert calls == [2]
