"""Typed bindings of the scripts a batch driver and the batch routes run:
``batch_lease.lua``, ``batch_move.lua`` and ``batch_done.lua`` touch one batch's keys, which
share its hash tag (one slot of a Redis Cluster); ``batch_open.lua`` one tenant's set."""

from __future__ import annotations

from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.scripts import ScriptCall, integer, script, text


def batch_lease(keys: Keys, batch_id: str, *, owner: str, ttl_ms: int) -> ScriptCall[bool]:
    """Take or renew ``owner``'s lease on the batch: True when it holds it now."""
    return ScriptCall(script("batch_lease"), (keys.batch_lease(batch_id),), (owner, ttl_ms),
                      lambda reply: integer(reply) == 1)


def batch_move(keys: Keys, batch_id: str, *, allowed: tuple[str, ...], status: str,
               fields: dict[str, str] | None = None) -> ScriptCall[str]:
    """Move the batch to ``status`` if it is in one of ``allowed`` now, writing
    ``fields`` (JSON values) with it; the status before ('' for no batch)."""
    pairs = [part for item in (fields or {}).items() for part in item]
    return ScriptCall(script("batch_move"), (keys.batch(batch_id),),
                      (" ".join(allowed), status, *pairs), text)


def batch_done(keys: Keys, batch_id: str, lines: list[tuple[int, str, int]]
               ) -> ScriptCall[int]:
    """Mark the lines (index, 'out' or 'err', tokens) done and count those not
    done before: the number newly done."""
    args = [str(part) for line in lines for part in line]
    return ScriptCall(script("batch_done"), (keys.batch(batch_id), keys.batch_done(batch_id)),
                      tuple(args), integer)


def batch_open(keys: Keys, batch_id: str, *, tenant: str, limit: int) -> ScriptCall[int]:
    """Count the batch among ``tenant``'s open batches if fewer than ``limit``
    are: 0 when added, else how many are open (nothing added)."""
    return ScriptCall(script("batch_open"), (keys.tenant_open_batches(tenant),),
                      (batch_id, limit), integer)
