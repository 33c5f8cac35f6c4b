"""The requests each tenant was refused, by reason, counted fleet-wide in Redis:
written by every gateway (``CountRefusals``), read by ``tokenfleet
metrics-exporter`` as ``tokenfleet_tenant_refusals_total{tenant, reason}``
(``tokenfleet.exporter.backlog``: the gateway itself needs no Prometheus client).

Only a request that came with an API key is counted (its key names the
tenant; the key itself is never a label, nor its id). The reasons:

- ``requests``, ``tokens``: the key's rpm or tpm (429); ``oversize``: one
  request asks more tokens than the key's tpm (429, never passes);
- ``tenant_queue_full``: the tenant's ``max_queued`` jobs (429);
  ``queue_full``: the model's queue (429);
- ``queue_not_allowed``: a model the key may not use (403);
  ``priority_not_allowed``: a priority above the key's max (403);
- ``invalid``: the request's fields or size (400, 413, 422);
- ``busy``: every Redis connection of the gateway in use (503);
  ``unavailable``: Redis out of reach (503: counted once Redis answers again,
  if the gateway's write got through).

The count is written after the response has started, on the gateway's
background tasks: a refused request waits for no write of its own.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.openai.errors import (OVER_TOKEN_RATE, PRIORITY_NOT_ALLOWED, QUEUE_FULL,
                                      QUEUE_NOT_ALLOWED, RATE_LIMITED, REDIS_BUSY, REDIS_DOWN,
                                      TENANT_QUEUE_FULL, TOKEN_RATE_LIMITED, Refusal)

log = logging.getLogger("tokenfleet.gateway.app")

# A refusal the gateway's handlers name (``note``) keeps its own reason ...
REASONS: dict[Refusal, str] = {
    RATE_LIMITED: "requests", TOKEN_RATE_LIMITED: "tokens", OVER_TOKEN_RATE: "oversize",
    TENANT_QUEUE_FULL: "tenant_queue_full", QUEUE_FULL: "queue_full",
    QUEUE_NOT_ALLOWED: "queue_not_allowed", PRIORITY_NOT_ALLOWED: "priority_not_allowed",
    REDIS_BUSY: "busy", REDIS_DOWN: "unavailable",
}
# ... any other answer with one of these statuses counts by its status; the
# rest (404 for an id, 401 without a tenant, a 500) are not refusals of a tenant.
BY_STATUS = {400: "invalid", 413: "invalid", 422: "invalid", 403: "queue_not_allowed",
             429: "requests", 503: "unavailable"}


def note(state: Any, refusal: Refusal) -> None:
    """Name the refusal a handler answers with (``request.state``), for its reason."""
    state.refusal = refusal


def reason_of(status: int, refusal: Refusal | None) -> str | None:
    """The reason a response with ``status`` is counted under, or None (not a refusal)."""
    if status not in BY_STATUS:
        return None
    if refusal is not None and refusal.status == status and refusal in REASONS:
        return REASONS[refusal]
    return BY_STATUS[status]


def field(tenant: str, reason: str) -> str:
    """The ``tenant_refusals`` field of a tenant's reason (a tenant name has no ':')."""
    return f"{tenant}:{reason}"


class CountRefusals:
    """ASGI middleware, inside ``Authenticate`` (which sets ``state.api_key``):
    counts each refusal of a keyed request once its response has started."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_counted(message: Message) -> None:
            # Counted before the response goes (a client gone by then was
            # refused all the same); the write is a task: nothing waits for it.
            if message["type"] == "http.response.start":
                state = scope.get("state", {})
                key = state.get("api_key")
                reason = reason_of(message["status"], state.get("refusal"))
                if key is not None and reason is not None:
                    fleet: AsyncFleetClient = scope["app"].state.fleet
                    fleet.in_background(_count(fleet, field(key.tenant, reason)))
            await send(message)

        await self.app(scope, receive, send_counted)


async def _count(fleet: AsyncFleetClient, name: str) -> None:
    try:
        await fleet.redis.hincrby(fleet.keys.tenant_refusals, name, 1)
    except (RedisError, OSError, TimeoutError) as exc:
        # A count lost to Redis being away; the refusal itself was answered.
        log.info("a refusal (%s) was not counted: %s", name, type(exc).__name__)
