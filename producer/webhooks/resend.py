"""Sending a given-up webhook event again (``tokenfleet webhooks retry``, the
console's "Send again"): back to the outbox under its own id, so a receiver
that saw it once drops the repeat, then off the dead list. The outbox gets
it first: a crash in between leaves a copy, never none."""

from __future__ import annotations

from typing import Any

from tokenfleet.shared.wire.keys import Keys

# What an outbox event is made of; the dead list's other fields (attempts,
# last error) are the record of its failure.
EVENT_FIELDS = ("id", "type", "data", "url", "tenant")


def event_of(fields: dict[str, str]) -> dict[str, str]:
    return {k: fields[k] for k in EVENT_FIELDS if fields.get(k)}


def resend(r: Any, keys: Keys, stream: str, entry_id: str, fields: dict[str, str]) -> None:
    r.xadd(keys.webhook_outbox, event_of(fields))
    r.xdel(stream, entry_id)


async def resend_async(r: Any, keys: Keys, stream: str, entry_id: str) -> bool:
    """``resend`` of one entry of a dead list on an asyncio client; False when
    it is no longer there (sent again already, or trimmed)."""
    found = await r.xrange(stream, entry_id, entry_id)
    if not found:
        return False
    fields = {k.decode(): v.decode() for k, v in found[0][1].items()}
    await r.xadd(keys.webhook_outbox, event_of(fields))
    await r.xdel(stream, entry_id)
    return True
