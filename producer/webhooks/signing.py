"""One webhook request as Standard Webhooks defines it: its body and its headers.

The body is ``{"type", "timestamp", "data"}``; the headers ``webhook-id`` (the
event's id: the same on every attempt, so a receiver drops a repeat),
``webhook-timestamp`` (the attempt's time, in seconds) and ``webhook-signature``
(``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``). A receiver checks
them with the ``standardwebhooks`` package (docs/webhooks.md). Each tenant's
events are signed with that tenant's key (:func:`tenant_key`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from datetime import UTC, datetime

import orjson

from tokenfleet.shared.wire.keys import DEFAULT_TENANT

SECRET_PREFIX = "whsec_"


def secret_key(secret: str) -> bytes:
    """The HMAC key of ``TOKENFLEET_WEBHOOK_SECRET``: the bytes a ``whsec_<base64>``
    secret encodes (what Standard Webhooks libraries generate), else the
    string's own UTF-8 bytes."""
    if secret.startswith(SECRET_PREFIX):
        try:
            return base64.b64decode(secret[len(SECRET_PREFIX):] + "==", validate=False)
        except binascii.Error as exc:
            raise ValueError(f"webhook secret {SECRET_PREFIX}... is not base64: {exc}") from None
    return secret.encode()


def tenant_key(operator_key: bytes, tenant: str) -> bytes:
    """The HMAC key of ``tenant``'s events: the operator's own for the default
    tenant (a fleet without tenants signs as it always has), else one derived
    from it and the tenant's name, so a receiver holding one tenant's secret
    cannot verify, nor be replayed, another tenant's events."""
    if tenant == DEFAULT_TENANT:
        return operator_key
    return hmac.new(operator_key, b"tokenfleet webhook tenant\x00" + tenant.encode(),
                    hashlib.sha256).digest()


def tenant_secret(secret: str, tenant: str) -> str:
    """``tenant``'s signing secret as its receiver takes it (``whsec_<base64>``):
    what ``tokenfleet webhooks secret --tenant NAME`` prints."""
    key = tenant_key(secret_key(secret), tenant)
    return SECRET_PREFIX + base64.b64encode(key).decode()


def event_time(entry_id: str) -> str:
    """The event's time (ISO 8601, UTC): when its outbox entry was added, which
    the entry's id tells to the millisecond."""
    ms = int(entry_id.split("-", 1)[0])
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def body(type: str, timestamp: str, data: str) -> bytes:
    """The request's body; ``data`` is the event's payload, JSON already."""
    return b'{"type":%s,"timestamp":%s,"data":%s}' % (
        orjson.dumps(type), orjson.dumps(timestamp), data.encode())


def headers(event_id: str, sent_at: int, payload: bytes, key: bytes | None) -> dict[str, str]:
    """The headers of one attempt at ``sent_at`` (Unix seconds); no signature
    without a key (a fleet with no secret set: docs/webhooks.md warns)."""
    out = {"content-type": "application/json", "user-agent": "tokenfleet-webhooks",
           "webhook-id": event_id, "webhook-timestamp": str(sent_at)}
    if key:
        signed = b"%s.%d.%s" % (event_id.encode(), sent_at, payload)
        digest = hmac.new(key, signed, hashlib.sha256).digest()
        out["webhook-signature"] = "v1," + base64.b64encode(digest).decode()
    return out
