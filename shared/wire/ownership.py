"""Who may see a job: the one rule every route that takes an id applies (jobs
today, batches once they exist).

A job belongs to the tenant that made it (``JobState.tenant``; none is the
tenant ``default``). Another tenant is told the id does not exist, the same
404 as for an id never made: a 403 would confirm the id to someone who may
have guessed or stolen it.
"""

from __future__ import annotations

from tokenfleet.shared.wire.keys import DEFAULT_TENANT
from tokenfleet.shared.wire.schemas import JobState


def tenant_or_default(tenant: str | None) -> str:
    return DEFAULT_TENANT if tenant is None else tenant


def owns(tenant: str | None, record: JobState) -> bool:
    """Whether a caller of ``tenant`` may read, stream or cancel the job ``record``."""
    return tenant_or_default(tenant) == tenant_or_default(record.tenant)
