"""What people running the fleet rely on: routing by model, priorities, metrics,
remote control, horizontal scale, and the status view of it all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet import FleetClient, NoWorker
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import JobStatus

from helpers import free_port, wait_until

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def test_jobs_route_to_the_worker_of_their_model_and_unserved_queues_show(
    client: FleetClient, start_worker: Any
) -> None:
    start_worker("alpha@test", queue="alpha")
    start_worker("beta@test", queue="beta")
    a = client.submit("to alpha", max_new_tokens=4, model="alpha")
    b = client.submit("to beta", max_new_tokens=4, model="beta")
    assert client.wait(a, timeout=60).worker == "alpha@test"
    assert client.wait(b, timeout=60).worker == "beta@test"
    with pytest.raises(NoWorker, match="no live worker serves queue 'gamma'"):
        client.submit("nobody", model="gamma", require_worker=True)
    waiting = client.submit("nobody yet", model="gamma", require_worker=False)
    from tokenfleet.client.fleet import fleet_status

    report = fleet_status(client)
    gamma = next(q for q in report["queues"] if q["queue"] == "gamma")
    assert gamma["unserved"] and gamma["depth"] == 1
    assert client.status(waiting).status is JobStatus.QUEUED


def test_higher_priorities_go_first_without_starving_the_lower(
    client: FleetClient, start_worker: Any
) -> None:
    # Queued ahead of the worker, so that every level has work waiting when it starts.
    jobs = {p: [client.submit(f"{p} {i}", max_new_tokens=2, priority=p, require_worker=False)
                for i in range(12)] for p in ("low", "normal", "high")}
    start_worker(max_batch=1, prefetch=0)
    states = [client.wait(j, timeout=120) for js in jobs.values() for j in js]
    order = [s.priority for s in sorted(states, key=lambda s: s.started_at or 0)]
    first = order[:14]
    assert first.count("high") == 8 and first.count("normal") == 4 and first.count("low") == 2
    # Low work started long before the high work ran out.
    assert order.index("low") < order.index("high") + 7


def test_metrics_count_jobs_tokens_and_latency(
    client: FleetClient, start_worker: Any
) -> None:
    port = free_port()
    start_worker(metrics_port=port)
    job_ids = [client.submit(f"metrics {i}", max_new_tokens=5, temperature=0.0) for i in range(6)]
    states = [client.wait(j, timeout=60) for j in job_ids]
    queued = client.submit("waits", max_new_tokens=7, model="default", priority="low")
    del queued

    def scrape() -> dict[str, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        return {f"{s.name}{sorted(s.labels.items())}": s.value
                for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}

    wait_until(lambda: scrape().get(
        "tokenfleet_jobs_total[('queue', 'default'), ('status', 'succeeded')]", 0) >= 7,
        timeout=30, what="the seventh job in the metrics")
    m = scrape()
    tokens = sum(len(s.token_ids) for s in states)
    assert m["tokenfleet_tokens_generated_total[('queue', 'default')]"] >= tokens
    assert m["tokenfleet_time_to_first_token_seconds_count[('queue', 'default')]"] >= 6
    assert m["tokenfleet_inter_token_latency_seconds_count[('queue', 'default')]"] >= tokens - 6
    assert m["tokenfleet_queue_wait_seconds_count[('queue', 'default')]"] >= 6
    assert m["tokenfleet_step_seconds_count[]"] > 0 and m["tokenfleet_batch_size_count[]"] > 0
    assert "tokenfleet_backlog_tokens[('queue', 'default')]" in m
    assert "tokenfleet_queue_depth[('priority', 'high'), ('queue', 'default')]" in m
    assert "tokenfleet_consumer_group_lag[('priority', 'normal'), ('queue', 'default')]" in m


def celery_cli(settings: Any, *args: str) -> str:
    env = {**os.environ, "TOKENFLEET_REDIS_URL": settings.redis_url,
           "TOKENFLEET_NAMESPACE": settings.namespace}
    out = subprocess.run([sys.executable, "-m", "celery", "-A", "tokenfleet.workers.app", *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_remote_control_inspects_drains_and_resumes_a_worker(
    settings: Any, client: FleetClient, celery_workers: Any, r: redis.Redis
) -> None:
    celery_workers("cpu@ctl")
    stats = json.loads(celery_cli(settings, "inspect", "engine_stats", "-d", "cpu@ctl", "--json"))
    assert stats["cpu@ctl"]["queue"] == "default" and "peak_batch" in stats["cpu@ctl"]["stats"]
    assert "draining" in celery_cli(settings, "control", "drain", "-d", "cpu@ctl")
    held = client.submit("held while draining", max_new_tokens=3)
    key = Keys(settings.namespace).worker("cpu@ctl")
    wait_until(lambda: r.hget(key, "draining") == b"1", timeout=10, what="the drain to show")
    assert client.status(held).status is JobStatus.QUEUED
    assert "resumed" in celery_cli(settings, "control", "resume", "-d", "cpu@ctl")
    assert client.wait(held, timeout=60).status is JobStatus.SUCCEEDED


@pytest.mark.slow
def test_three_workers_two_models_share_the_load_and_status_shows_them_all(
    settings: Any, client: FleetClient, celery_workers: Any, tiny_dir: Path
) -> None:
    celery_workers("cpu@host1", TOKENFLEET_QUEUE="alpha", TOKENFLEET_MAX_BATCH="4")
    celery_workers("cpu@host2", TOKENFLEET_QUEUE="alpha", TOKENFLEET_MAX_BATCH="4")
    alpha = [client.submit(f"alpha {i}", max_new_tokens=40, model="alpha") for i in range(24)]
    beta = [client.submit(f"beta {i}", max_new_tokens=20, model="beta", require_worker=False)
            for i in range(6)]  # queued ahead: their worker comes next
    # A worker added mid-run picks up the queued beta jobs at once.
    celery_workers("cpu@host3", model="tiny-random", TOKENFLEET_QUEUE="beta")
    env = {**os.environ, "TOKENFLEET_REDIS_URL": settings.redis_url,
           "TOKENFLEET_NAMESPACE": settings.namespace}
    during = subprocess.run([sys.executable, "-m", "tokenfleet.cli.app", "status", "--json"], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    report = json.loads(during.stdout)
    assert {q["queue"] for q in report["queues"]} == {"alpha", "beta"}
    assert {w["name"]: (w["queue"], w["device"]) for w in report["workers"]} == {
        "cpu@host1": ("alpha", "cpu"), "cpu@host2": ("alpha", "cpu"), "cpu@host3": ("beta", "cpu")}
    shown = subprocess.run([sys.executable, "-m", "tokenfleet.cli.app", "status"], env={**env, "COLUMNS": "200"},
                           cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    for name in ("alpha", "beta", "cpu@host1", "cpu@host2", "cpu@host3", "tiny-random", "tokens/s"):
        assert name in shown
    states = [client.wait(j, timeout=180) for j in alpha + beta]
    assert all(s.status is JobStatus.SUCCEEDED for s in states)
    alpha_workers = {s.worker for s in states[:24]}
    assert alpha_workers == {"cpu@host1", "cpu@host2"}
    assert {s.worker for s in states[24:]} == {"cpu@host3"}


@pytest.mark.slow
def test_flower_lists_the_workers(settings: Any, celery_workers: Any) -> None:
    import httpx

    celery_workers("cpu@flowered")
    port = free_port()
    env = {**os.environ, "TOKENFLEET_REDIS_URL": settings.redis_url,
           "TOKENFLEET_NAMESPACE": settings.namespace, "FLOWER_UNAUTHENTICATED_API": "true"}
    flower = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tokenfleet.workers.app", "flower",
                               f"--port={port}", "--address=127.0.0.1"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listed() -> Any:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=10)
            except httpx.HTTPError:
                return None
            return reply.status_code == 200 and "cpu@flowered" in reply.json()

        wait_until(listed, timeout=60, what="Flower to list the worker")
    finally:
        flower.terminate()
        flower.wait(timeout=10)
