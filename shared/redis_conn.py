"""Redis clients that ride out a restart or a dropped connection.

Every command is retried with exponential backoff on connection errors and
timeouts, so a producer or worker waits for Redis to come back instead of
dying; callers with loops of their own (the feeder, subscribers) also back off.
``rediss://`` and ``user:password@`` URLs work as redis-py parses them.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

# Ten retries with a backoff capped at 2 s ride out a restart of ~15 s.
RETRIES = 10
# Each live stream()/wait() holds a pub/sub connection of its own: a web backend
# following hundreds of jobs needs more than redis-py's default of 100.
MAX_CONNECTIONS = 2000
RETRY_ERRORS: list[type[Exception]] = [ConnectionError, TimeoutError, ConnectionResetError]


def _options() -> dict[str, Any]:
    return {
        "decode_responses": False,
        "health_check_interval": 30,
        "socket_keepalive": True,
        "socket_connect_timeout": 5,
        # A half-open connection (a peer gone without a FIN) fails instead of
        # hanging a thread forever; far above any BLOCK the fleet uses.
        "socket_timeout": 60,
        "retry_on_error": RETRY_ERRORS,
        "max_connections": MAX_CONNECTIONS,
    }


def connect(url: str) -> redis.Redis:
    from redis.retry import Retry

    return redis.Redis.from_url(
        url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), RETRIES), **_options()
    )


def connect_async(url: str) -> aioredis.Redis:
    from redis.asyncio.retry import Retry

    return aioredis.Redis.from_url(
        url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), RETRIES), **_options()
    )


def text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def decode_hash(fields: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in fields.items()}
