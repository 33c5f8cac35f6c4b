"""Tenants on a real redis-server: each has streams of its own, the queue's
limits count them all, and ``fair.lua`` deals a worker's credits among them by
weighted virtual tokens served."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from prometheus_client import generate_latest

from tokenfleet import FleetClient, InvalidRequest, QueueFull
from tokenfleet.client.fleet import repair_fleet
from tokenfleet.shared.wire.keys import Keys, level_queue
from tokenfleet.shared.wire.schemas import FinishReason, SamplingParams
from tokenfleet.workers.fair_share import TenantStreams
from tokenfleet.workers.metrics import Metrics
from tokenfleet.workers.sequence import SeqOutput, Sequence
from tokenfleet.workers.stats import WorkerStats

pytestmark = pytest.mark.timeout(60)

PROMPT = "the same prompt"  # every job weighs the same: exact shares


def queue_jobs(client: FleetClient, tenant: str | None, n: int) -> list[str]:
    return [client.submit(PROMPT, max_new_tokens=8, tenant=tenant, require_worker=False)
            for _ in range(n)]


def dealt(streams: TenantStreams, credits: int) -> dict[str, int]:
    """Tenant -> how many entries one fair read of ``credits`` at normal gave."""
    streams.refresh(force=True)
    got: dict[str, int] = {}
    for stream, entries in streams.read_fair({"normal": credits}):
        tenant = streams.keys.queue_of(stream).split(":")[2]
        got[tenant] = got.get(tenant, 0) + len(entries)
    return got


def tenant_streams(r: redis.Redis, settings: Any, **overrides: Any) -> TenantStreams:
    streams = TenantStreams(r, Keys(settings.namespace), settings.model_copy(update=overrides),
                            "default", "w1@test")
    streams.ensure_groups()
    return streams


def test_a_tenants_job_waits_in_its_own_stream_and_its_record_names_it(
        client: FleetClient, r: redis.Redis, settings: Any) -> None:
    keys = Keys(settings.namespace)
    job_id, = queue_jobs(client, "acme", 1)
    assert r.hget(keys.job(job_id), "tenant") == b"acme"
    assert r.xlen(keys.queue(level_queue("default", "normal", "acme"))) == 1
    assert r.smembers(keys.tenants("default")) == {b"acme"}
    plain, = queue_jobs(client, None, 1)  # no tenant: the plain stream, no field
    assert r.hget(keys.job(plain), "tenant") is None
    assert r.xlen(keys.queue("default")) == 1
    assert client.cancel(job_id)  # off its tenant's stream at once
    assert r.xlen(keys.queue(level_queue("default", "normal", "acme"))) == 0


def test_a_bad_tenant_name_is_refused_by_name(client: FleetClient) -> None:
    with pytest.raises(InvalidRequest, match="tenant must be 1 to 64 letters"):
        client.submit("hi", tenant="a:b", require_worker=False)


def test_max_queue_counts_every_tenants_jobs(settings: Any) -> None:
    small = settings.model_copy(update={"max_queue": 3})
    with FleetClient(settings=small) as first:
        for tenant in ("a", "b", None):
            queue_jobs(first, tenant, 1)
    # A client that has never heard of tenants a and b counts them too.
    with FleetClient(settings=small) as other, pytest.raises(QueueFull):
        queue_jobs(other, "c", 1)


def test_credits_follow_the_tenants_weights(client: FleetClient, r: redis.Redis,
                                           settings: Any) -> None:
    queue_jobs(client, "a", 30)
    queue_jobs(client, "b", 30)
    streams = tenant_streams(r, settings, tenant_weights={"a": 2.0})
    assert dealt(streams, 12) == {"a": 8, "b": 4}
    assert dealt(streams, 3) == {"a": 2, "b": 1}


def test_a_tenant_alone_takes_every_credit(client: FleetClient, r: redis.Redis,
                                           settings: Any) -> None:
    queue_jobs(client, "a", 10)
    queue_jobs(client, "quiet", 1)
    streams = tenant_streams(r, settings)
    assert dealt(streams, 2) == {"a": 1, "quiet": 1}
    assert dealt(streams, 10) == {"a": 9}  # all there is, though 10 were asked


def test_an_idle_tenant_comes_back_ahead_by_the_burst_only(
        client: FleetClient, r: redis.Redis, settings: Any) -> None:
    queue_jobs(client, "a", 30)
    queue_jobs(client, "b", 1)
    weight = int(r.xrange(Keys(settings.namespace).queue(level_queue("default", "normal", "a")),
                          count=1)[0][1][b"w"])
    streams = tenant_streams(r, settings, fair_share_burst_tokens=2 * weight)
    assert dealt(streams, 11) == {"a": 10, "b": 1}  # b's one job, then b is idle
    queue_jobs(client, "b", 10)
    # b banked two jobs' worth while idle, not the ten a ran: two first, then turns.
    assert dealt(streams, 10) == {"a": 4, "b": 6}


def test_forgetting_a_queue_takes_its_tenants_streams_too(
        client: FleetClient, r: redis.Redis, settings: Any) -> None:
    keys = Keys(settings.namespace)
    job_id, = queue_jobs(client, "acme", 1)
    assert client.cancel(job_id)  # nothing queued, no consumer group, no worker
    assert repair_fleet(client).forgotten == ["default"]
    assert not r.exists(keys.queue(level_queue("default", "normal", "acme")),
                        keys.tenants("default"))


def test_each_tenants_jobs_and_tokens_show_in_the_metrics() -> None:
    stats = WorkerStats()
    metrics = Metrics("q", stats)
    seq = Sequence(job_id="q:1", prompt_ids=[1], sampling=SamplingParams(),
                   text=None, queue=level_queue("q", "high", "acme"))  # type: ignore[arg-type]
    seq.generated = [5, 6, 7]
    seq.finish_reason = FinishReason.LENGTH
    stats.record_outputs([SeqOutput(seq, 2, 7, "", True)])
    metrics.queue_state({}, backlog=0, running=0,
                        tenants={"acme": {"depth": 5, "pending": 2}, "default": {"depth": 1,
                                                                                "pending": 1}})
    text = generate_latest(metrics.registry).decode()
    assert 'tokenfleet_tenant_tokens_generated_total{queue="q",tenant="acme"} 3.0' in text
    assert 'tokenfleet_tenant_queued_jobs{queue="q",tenant="acme"} 3.0' in text
    assert 'tokenfleet_tenant_running_jobs{queue="q",tenant="acme"} 2.0' in text
    assert 'tokenfleet_tenant_queued_jobs{queue="q",tenant="default"} 0.0' in text


def test_the_backlog_exporter_counts_every_tenants_jobs(
        client: FleetClient, r: redis.Redis, settings: Any) -> None:
    # What an autoscaler reads must see a tenant's jobs as well as the default's.
    from tokenfleet.exporter.backlog import registry

    queue_jobs(client, "acme", 2)
    queue_jobs(client, None, 1)
    text = generate_latest(registry(r, Keys(settings.namespace))).decode()
    assert 'tokenfleet_queue_backlog{priority="normal",queue="default"} 3.0' in text, text
