"""Typed binding of the script a webhook deliverer runs: ``webhook_take.lua``
(one tenant's lane: one slot of a Redis Cluster)."""

from __future__ import annotations

from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.scripts import ScriptCall, items, script, text


def webhook_take(keys: Keys, tenant: str, *, now: float, lease_until: float,
                 count: int) -> ScriptCall[list[str]]:
    """Lease up to ``count`` of ``tenant``'s events due at ``now`` until
    ``lease_until``: their ids."""
    return ScriptCall(script("webhook_take"), (keys.webhook_lane(tenant),),
                      (repr(now), repr(lease_until), count),
                      lambda reply: [text(x) for x in items(reply)])
