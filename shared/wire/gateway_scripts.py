"""Typed bindings of the scripts a gateway runs for its API keys:
``rate_take.lua``, ``rate_settle.lua`` and ``tenant_admit.lua``.

Each script's keys share one hash tag (the key id's, or the tenant's), so each
call touches one slot of a Redis Cluster.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.scripts import ScriptCall, integer, items, script, text

# The window rpm and tpm count over.
WINDOW_S = 60.0


class RateVerdict(enum.Enum):
    """What ``rate_take.lua`` did with a request."""

    OK = "ok"  # counted
    REQUESTS = "requests"  # over the key's rpm: nothing counted
    TOKENS = "tokens"  # over the key's tpm: nothing counted
    OVERSIZE = "oversize"  # asks more tokens than tpm on its own: can never pass


@dataclass(frozen=True)
class RateState:
    """A key's use of its window after ``rate_take.lua``, and when it frees up."""

    verdict: RateVerdict
    requests: int  # requests in the window
    tokens: int  # tokens charged in the window
    retry_after_s: float  # refused: when the same request would pass
    requests_reset_s: float  # until the requests' window is empty (the whole rpm back)
    tokens_reset_s: float  # until the tokens' window is empty


def _rate_state(reply: object) -> RateState:
    verdict, requests, tokens, retry, reset_requests, reset_tokens = (
        text(x) for x in items(reply))
    return RateState(RateVerdict(verdict), int(requests), int(float(tokens)), float(retry),
                     float(reset_requests), float(reset_tokens))


def rate_take(keys: Keys, *, key_id: str, request_id: str, now: float, rpm: int | None,
              tpm: int | None, requests: int, tokens: int) -> ScriptCall[RateState]:
    """Count ``requests`` (1, or 0 to read the state) and ``tokens`` against a
    key's limits at ``now`` (the fleet's clock); a limit None is none."""
    return ScriptCall(
        script("rate_take"),
        (keys.rate_requests(key_id), keys.rate_tokens(key_id), keys.rate_token_total(key_id)),
        (repr(now), repr(WINDOW_S), rpm or 0, tpm or 0, request_id, requests, tokens),
        _rate_state,
    )


def rate_settle(keys: Keys, *, key_id: str, request_id: str, charged: int,
                used: int) -> ScriptCall[bool]:
    """Correct a request's charge of ``charged`` tokens to ``used``; False when
    it had left the window already."""
    return ScriptCall(
        script("rate_settle"),
        (keys.rate_tokens(key_id), keys.rate_token_total(key_id)),
        (request_id, charged, used),
        lambda reply: integer(reply) == 1,
    )


@dataclass(frozen=True)
class TenantAdmission:
    """``tenant_admit.lua``'s verdict: reserved or not, and the tenant's jobs."""

    reserved: bool
    jobs: int


def _tenant_admission(reply: object) -> TenantAdmission:
    verdict, jobs = items(reply)
    return TenantAdmission(text(verdict) == "ok", integer(jobs))


def tenant_admit(keys: Keys, *, tenant: str, cap: int, reservation: str,
                 now: float) -> ScriptCall[TenantAdmission]:
    """Reserve a place for one job of ``tenant`` if it has fewer than ``cap``."""
    return ScriptCall(
        script("tenant_admit"),
        (keys.tenant_jobs(tenant),),
        (cap, reservation, repr(now)),
        _tenant_admission,
    )
