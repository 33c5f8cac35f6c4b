"""A Redis that comes back empty (no persistence) does not stop a worker for good."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.schemas import JobStatus

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]


def test_a_worker_serves_again_after_redis_lost_everything(
    r: redis.Redis, settings: Any, start_worker: Any, client: FleetClient
) -> None:
    start_worker()
    first = client.submit("before", max_new_tokens=3)
    assert client.wait(first, timeout=30).status is JobStatus.SUCCEEDED
    r.flushall()  # the stream and its consumer group are gone
    # So is the list of live workers until the next heartbeat: queue ahead of it.
    after = client.submit("after", max_new_tokens=3, require_worker=False)
    assert client.wait(after, timeout=30).status is JobStatus.SUCCEEDED
