"""The durable outbox of webhook events: a stream every deliverer reads as a group.

An event is added once, where its cause is recorded (a batch's end, a job's),
and delivered at least once by whichever gateway's deliverer takes it; the
receiver dedups by the event's ``webhook-id``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable
from typing import Any, Protocol
from urllib.parse import urlsplit

from tokenfleet.shared.wire.keys import Keys

# The longest webhook URL a job or batch may name (browsers' and proxies' common limit).
MAX_WEBHOOK_URL = 2048


class _Adds(Protocol):
    def xadd(self, name: str, fields: dict[str, str]) -> Awaitable[Any] | Any: ...


def event_fields(type: str, data: dict[str, Any], url: str | None = None,
                 tenant: str | None = None) -> dict[str, str]:
    """The stream entry of one event: its id (the ``webhook-id`` every attempt
    carries), its type (``batch.completed``, ...), its JSON payload, when it
    has one the URL it goes to (else the fleet's ``TOKENFLEET_WEBHOOK_URL``),
    and whose it is (its tenant's delivery lane, caps and signing secret; none:
    the default tenant's)."""
    fields = {"id": f"msg_{uuid.uuid4().hex}", "type": type,
              "data": json.dumps(data, separators=(",", ":"))}
    if url:
        fields["url"] = url
    if tenant:
        fields["tenant"] = tenant
    return fields


async def add_event(client: _Adds, keys: Keys, type: str, data: dict[str, Any],
                    url: str | None = None, tenant: str | None = None) -> None:
    """Queue one event for delivery (async Redis client)."""
    await client.xadd(keys.webhook_outbox, event_fields(type, data, url, tenant))


def webhook_url_problem(url: str) -> str | None:
    """What is wrong with a webhook URL, or None: an absolute http:// or
    https:// URL with a host, at most ``MAX_WEBHOOK_URL`` characters."""
    if len(url) > MAX_WEBHOOK_URL:
        return f"webhook_url is {len(url)} characters long, over the limit of {MAX_WEBHOOK_URL}"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        return f"webhook_url is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return (f"webhook_url must be an absolute http:// or https:// URL with a host, "
                f"got {url[:80]!r}")
    if any(c.isspace() or ord(c) < 32 for c in url):
        return "webhook_url must not hold spaces or control characters"
    if "@" in parts.netloc:  # it would be sent as Basic auth, to wherever the host points
        return ("webhook_url must not hold credentials (user:password@); a receiver checks "
                "the webhook-signature header instead")
    return None
