"""A pool scaled to zero: a declared queue takes jobs with no live worker, the
backlog they form is what the exporter shows a KEDA ScaledObject, and a worker
that starts drains it back to zero. An undeclared queue keeps ``NoWorker``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet import AsyncFleetClient, FleetClient, NoWorker
from tokenfleet.client.fleet import fleet_status, plain
from tokenfleet.shared.wire.keys import PRIORITIES
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.settings import get_settings

from gateway_server import gateway  # noqa: F401  (a fixture)
from helpers import free_port, wait_until

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
POOL = "pool"


def cli(settings: Any, *args: str) -> Result:
    from tokenfleet.cli.app import main

    result = CliRunner().invoke(main, list(args), env={
        "TOKENFLEET_REDIS_URL": settings.redis_url, "TOKENFLEET_NAMESPACE": settings.namespace})
    get_settings.cache_clear()  # read under the runner's environment: not this process's
    return result


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())
    except (urllib.error.URLError, ConnectionError):
        return None


@pytest.fixture
def exporter(settings: Any) -> Iterator[int]:
    """``tokenfleet metrics-exporter`` as a pool's Deployment runs it; its port."""
    port = free_port()
    env = {**os.environ, "TOKENFLEET_REDIS_URL": settings.redis_url,
           "TOKENFLEET_NAMESPACE": settings.namespace}
    proc = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli.app", "metrics-exporter",
                             "--host", "127.0.0.1", "--port", str(port)],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until(lambda: proc.poll() is not None or scrape(port), timeout=60,
               what="the metrics exporter to serve")
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    yield port
    proc.terminate()
    proc.wait(timeout=10)


def backlog(port: int, queue: str) -> dict[str, float]:
    """``tokenfleet_queue_backlog`` of ``queue`` by priority, from the text a
    Prometheus scrape gets: each level's stream length, which the ScaledObject's
    triggers read from Redis and add (tests/test_keda_scaler.py)."""
    text = scrape(port)
    assert text is not None
    return {s.labels["priority"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "tokenfleet_queue_backlog" and s.labels["queue"] == queue}


async def submit_async(settings: Any) -> str:
    async with AsyncFleetClient(settings=settings) as c:
        return await c.submit("from asyncio", model=POOL, max_new_tokens=1)


@pytest.mark.slow
def test_a_declared_queue_takes_jobs_with_no_worker_and_a_worker_drains_its_backlog(
    client: FleetClient, settings: Any, start_worker: Any, exporter: int
) -> None:
    assert cli(settings, "queue", "create", POOL).exit_code == 0
    # Declared, nothing queued yet: the scaler's query reads 0, not nothing.
    assert backlog(exporter, POOL) == {p: 0 for p in PRIORITIES}

    ids = [client.submit(f"job {i}", model=POOL, max_new_tokens=1, priority=PRIORITIES[i % 3])
           for i in range(99)]
    ids.append(asyncio.run(submit_async(settings)))
    assert backlog(exporter, POOL) == {"high": 33, "normal": 34, "low": 33, "batch": 0}

    report = fleet_status(client)
    [queue] = [q for q in report["queues"] if q["queue"] == POOL]
    assert (queue["workers"], queue["depth"], queue["min_workers"]) == (0, 100, 0)
    assert queue["backlog_tokens"] > 0
    assert "none (autoscaled, min 0)" in plain(report)

    start_worker(queue=POOL, max_batch=64)
    states = [client.wait(job_id, timeout=120) for job_id in ids]
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 100
    assert all(len(s.token_ids) == 1 for s in states)
    assert backlog(exporter, POOL) == {p: 0 for p in PRIORITIES}
    text = scrape(exporter) or ""
    assert f'tokenfleet_queue_backlog_tokens{{queue="{POOL}"}} 0.0' in text
    assert f'tokenfleet_queue_live_workers{{queue="{POOL}"}} 1.0' in text


def test_only_a_declared_queue_takes_jobs_with_no_worker_and_the_gateway_lists_it(
    client: FleetClient, settings: Any, gateway: Any
) -> None:
    with pytest.raises(NoWorker):
        client.submit("nobody", model=POOL)
    created = cli(settings, "queue", "create", POOL, "--min-workers", "2")
    assert created.exit_code == 0, created.output
    listed = cli(settings, "queue", "list")
    assert listed.output.split("\n")[1].split() == [POOL, "2", "0", "0", "0"]

    http = gateway()
    [model] = [m for m in http.get("/v1/models").json()["data"] if m["id"] == POOL]
    assert model["workers"] == 0
    assert http.get(f"/v1/models/{POOL}").json()["id"] == POOL
    accepted = http.post("/v1/jobs", json={"prompt": "wait for the pool", "model": POOL})
    assert accepted.status_code == 202
    assert client.status(accepted.json()["id"]).status is JobStatus.QUEUED

    assert cli(settings, "queue", "delete", POOL).exit_code == 0
    with pytest.raises(NoWorker):  # undeclared again: refused again
        client.submit("nobody", model=POOL)
    missing = cli(settings, "queue", "delete", POOL)
    assert missing.exit_code == 1 and "is not declared" in missing.output
    bad = cli(settings, "queue", "create", "no spaces")
    assert bad.exit_code == 2 and "queue name must be" in bad.output
    assert httpx.codes.is_success(http.get("/readyz").status_code)
