"""The pool's ScaledObject, queried as KEDA's redis-streams scaler queries it,
sees a queue's waiting jobs at every priority level, and zero once a worker
has served them.

KEDA v2.20.2 (pkg/scalers/redis_streams_scaler.go, with lagCount set) reads
``XINFO GROUPS <stream>`` and takes the consumer group's ``lag``; a stream that
does not exist reads 0, and a stream without the group reads its ``XLEN`` (no
worker has joined yet). The ScaledObject's formula adds the levels' values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.kustomize import Obj, of_kind, render
from tokenfleet.shared.keys import PRIORITIES
from tokenfleet.shared.schemas import JobStatus

pytestmark = pytest.mark.timeout(120)


def keda_lag(r: redis.Redis, stream: str, group: str) -> int:
    """What one redis-streams trigger reads, the way KEDA 2.20.2 reads it."""
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError as e:
        if "no such key" in str(e):
            return 0
        raise
    for info in groups:
        name = info["name"]
        if (name.decode() if isinstance(name, bytes) else name) == group:
            return int(info["lag"])
    return int(r.xlen(stream))


@pytest.fixture(scope="module")
def triggers() -> dict[str, Obj]:
    [scaled] = of_kind(render("cpu"), "ScaledObject")
    return {t["name"]: t["metadata"] for t in scaled["spec"]["triggers"]}


def test_the_scaler_sees_jobs_at_every_level_and_zero_after_a_worker(
        triggers: dict[str, Obj], settings: Any, client: Any, r: redis.Redis,
        start_worker: Callable[..., Any]) -> None:
    # The rendered streams are the default namespace's; this test's Redis keys
    # carry a namespace of their own.
    def formula() -> dict[str, int]:
        return {level: keda_lag(r, meta["stream"].replace("tokenfleet:", f"{settings.namespace}:",
                                                          1), meta["consumerGroup"])
                for level, meta in triggers.items()}

    queue = "default"
    assert formula() == dict.fromkeys(PRIORITIES, 0)  # no stream yet: nothing to wake for
    jobs = {level: [client.submit("Hello", model=queue, priority=level, max_new_tokens=2,
                                  require_worker=False) for _ in range(n)]
            for level, n in zip(PRIORITIES, (1, 2, 3))}
    assert formula() == {"high": 1, "normal": 2, "low": 3}  # the pool at zero wakes: 6 > 0
    start_worker(queue=queue)
    for job_id in sum(jobs.values(), []):
        assert client.wait(job_id, timeout=60).status is JobStatus.SUCCEEDED
    assert formula() == dict.fromkeys(PRIORITIES, 0)  # the pool may go back to zero
