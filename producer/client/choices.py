"""One request fanned out to n choices: n jobs that share the prompt and the
sampling, each a job of its own in Redis (queued, run, resumed and cancelled
like any other), told apart by ``SamplingParams.choice_index``.

With a ``seed``, choice i draws with ``choice_seed(seed, i)``: it is the same
as the single request with that seed and ``choice_index=i``, and choice 0 is
the plain seeded request. Without one, each choice draws on its own.
"""

from __future__ import annotations

from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.wire.schemas import MAX_IDEMPOTENCY_KEY, GenerationRequest
from tokenfleet.shared.settings import Settings


def check_n(n: object, settings: Settings, name: str = "n") -> int:
    """``n`` as a count of choices: an integer from 1 to ``settings.max_n``,
    else ``InvalidRequest`` naming ``name`` and the limit."""
    if type(n) is not int or n < 1:
        raise InvalidRequest(f"invalid {name!r}: must be an integer of at least 1, got {n!r}")
    if n > settings.max_n:
        raise InvalidRequest(f"invalid {name!r}: {n} choices asked for, this fleet allows at "
                             f"most {settings.max_n} per request (TOKENFLEET_MAX_N)")
    return n


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The n jobs of ``request``, choice 0 first. An idempotency key becomes one
    per choice (``key``, ``key#1``, ``key#2``...), so a retry of the whole
    fan-out finds every choice's job again."""
    if request.sampling.choice_index != 0:
        raise InvalidRequest("invalid 'choice_index': a request fanned out to n choices numbers "
                             "them itself; leave choice_index unset")
    key = request.idempotency_key
    if key is not None and n > 1 and len(f"{key}#{n - 1}") > MAX_IDEMPOTENCY_KEY:
        raise InvalidRequest(f"invalid 'idempotency_key': with n={n} choices it takes a suffix "
                             f"#1 to #{n - 1}, and must stay within {MAX_IDEMPOTENCY_KEY} "
                             "characters")
    out = []
    for index in range(n):
        sampling = request.sampling.model_copy(update={"choice_index": index})
        update: dict[str, object] = {"sampling": sampling}
        if key is not None and index:
            update["idempotency_key"] = f"{key}#{index}"
        out.append(request.model_copy(update=update))
    return out
