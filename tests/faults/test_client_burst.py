"""One client, a burst of concurrent submits (a web backend under a spike):
more commands at once than the client's connections. Each waits its turn for a
free connection and succeeds; none raises ``MaxConnectionsError``.

No worker is needed: the jobs queue ahead of the workers."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from tokenfleet import AsyncFleetClient, FleetClient
from tokenfleet.shared.redis import connect as redis_conn
from tokenfleet.shared.wire.keys import Keys

from helpers import queue_parts

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(300)]

BURST = 3000  # concurrent submits: far past the client's connections (redis-py's cap: 2,000)


def queued(r: redis.Redis, keys: Keys) -> int:
    return sum(r.xlen(keys.queue(p)) for p in queue_parts(r, keys))


async def test_3000_concurrent_submits_from_one_async_client_all_succeed(
    settings: Any, r: redis.Redis, report: dict[str, Any],
) -> None:
    assert BURST > redis_conn.MAX_CONNECTIONS > redis_conn.ASYNC_CONNECTIONS
    async with AsyncFleetClient(settings=settings) as client:
        job_ids = await asyncio.gather(*(
            client.submit(f"burst {i}", max_new_tokens=2, require_worker=False)
            for i in range(BURST)), return_exceptions=True)
    failed = [f"{type(j).__name__}: {j}" for j in job_ids if isinstance(j, BaseException)]
    assert failed == [], f"{len(failed)} failed, first: {failed[0]}"
    assert len(set(job_ids)) == BURST
    assert queued(r, Keys(settings.namespace)) == BURST
    report.update(concurrent_submits=BURST, failed=0)


def test_more_threads_submitting_than_the_sync_clients_connections_all_succeed(
    settings: Any, r: redis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A small cap, so a few threads outnumber it (thousands of threads would
    # do the same with the real one). On a cluster, the cluster client's retry
    # backs off from a full node pool.
    monkeypatch.setattr(redis_conn, "MAX_CONNECTIONS", 4)
    threads = 48
    with FleetClient(settings=settings) as client, ThreadPoolExecutor(threads) as pool:
        job_ids = list(pool.map(
            lambda i: client.submit(f"thread {i}", max_new_tokens=2, require_worker=False),
            range(threads * 4)))
    assert len(set(job_ids)) == threads * 4
    assert queued(r, Keys(settings.namespace)) == threads * 4
