"""Nothing lost, nothing twice: a worker killed mid-batch, Redis restarted mid-run,
a worker drained with jobs in flight."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import GROUP, Keys
from tokenfleet.shared.wire.schemas import JobStatus

from helpers import (ChannelTally, direct_greedy, follow_all, logged_tokens, queue_parts,
                     redis_client, stream_fault, wait_until)
from placed_kill import frozen_mid_job

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

WORDS = "the value of a list is returned when the module calls its function".split()


def prompts(n: int) -> list[tuple[str, int]]:
    return [(" ".join(WORDS[i % 7: i % 7 + 2 + i % 5]), 16 + (i * 7) % 24) for i in range(n)]



def test_kill_9_mid_batch_loses_nothing_and_runs_nothing_twice(
    settings: Any, client: FleetClient, celery_workers: Any, r: redis.Redis,
    loaded_tiny: Any, report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    jobs = prompts(200)
    # Queued ahead of the workers: the whole batch waits when the first one starts.
    job_ids = [client.submit(p, max_new_tokens=n, temperature=0.0, require_worker=False)
               for p, n in jobs]
    tally = ChannelTally(settings.redis_url, keys, job_ids)
    consumers, seen = follow_all(settings, job_ids)
    first = celery_workers("cpu@first", TOKENFLEET_MAX_BATCH="32", TOKENFLEET_CLAIM_IDLE_S="2")

    def succeeded() -> int:
        pipe = r.pipeline()
        for j in job_ids:
            pipe.hget(keys.job(j), "status")
        return sum(1 for s in pipe.execute() if s == b"succeeded")

    wait_until(lambda: succeeded() >= 40, timeout=120, what="40 jobs to finish before the kill")
    with frozen_mid_job(first.proc, r, keys, "cpu@first", job_ids) as running:
        in_flight = sum(r.xpending(keys.queue(p), GROUP)["pending"] for p in queue_parts(r, keys))
        first.kill()  # SIGKILL: no drain, no hand-back, pending entries stay with cpu@first
    killed_at = time.monotonic()
    done_at_kill = succeeded()
    # A new process under another name takes the dead one's entries after claim_idle_s.
    celery_workers("cpu@second", TOKENFLEET_MAX_BATCH="32", TOKENFLEET_CLAIM_IDLE_S="2")
    wait_until(lambda: succeeded() > done_at_kill, timeout=60, what="the first job after the kill")
    recovery_s = time.monotonic() - killed_at
    states = [client.wait(j, timeout=180) for j in job_ids]
    consumers.join(timeout=60)
    tally.wait_ended(job_ids, timeout=30)
    tally.close()

    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 200
    resumed = [s for s in states if s.attempts > 1]
    assert {s.id for s in resumed} >= set(running), running
    # Every final state was written once; every token was published once.
    assert tally.ends_not_once(job_ids) == {}  # each end published once
    duplicated = tally.duplicated
    assert duplicated == 0
    assert sum(tally.tokens.values()) == sum(len(s.token_ids) for s in states)
    for state in states:
        assert stream_fault(seen[state.id], state) == "", state.id
    assert [s.text for s in states] == direct_greedy(loaded_tiny, jobs)
    report.update(accepted=200, completed=len(states), lost=0, duplicated=duplicated,
                  in_flight_at_kill=in_flight, resumed=len(resumed),
                  recovery_s=round(recovery_s, 2))


def test_redis_restart_mid_run_every_accepted_job_finishes(
    aof_redis: Any, namespace: str, celery_workers: Any, report: dict[str, Any]
) -> None:
    from tokenfleet.shared.settings import Settings

    settings = Settings(queue="default", redis_url=aof_redis.url, namespace=namespace)
    client = FleetClient(settings=settings)
    r = redis_client(aof_redis.url)
    keys = Keys(namespace)
    job_ids = [client.submit(f"restart {i} {' '.join(WORDS[:i % 9])}", max_new_tokens=60,
                             temperature=0.0, require_worker=False) for i in range(60)]
    worker = _celery_on(celery_workers, settings, "cpu@survivor")
    wait_until(lambda: r.hget(keys.job(job_ids[5]), "status") == b"succeeded", timeout=60,
               what="a few jobs to finish before the restart")
    aof_redis.stop()  # SIGTERM: Redis writes its append-only file and exits
    down_at = time.monotonic()
    time.sleep(1.0)  # the outage itself: clients and the worker see refused connections
    aof_redis.start()
    try:
        states = [client.wait(j, timeout=120) for j in job_ids]
    except TimeoutError:
        pending = [r.xpending(keys.queue(p), GROUP) for p in queue_parts(r, keys)]
        statuses = Counter(r.hget(keys.job(j), "status") for j in job_ids)
        raise AssertionError(f"jobs stuck after the restart: {statuses}, pending {pending}, "
                             f"groups {[r.xinfo_groups(keys.queue(p)) for p in queue_parts(r, keys)]}\n"
                             f"worker log:\n{worker.output()[-4000:]}") from None
    recovery_s = time.monotonic() - down_at
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 60
    assert worker.proc.poll() is None, "the worker died with Redis"
    # After the restart, new work flows through the same processes.
    after = client.submit("after the restart", max_new_tokens=5)
    assert client.wait(after, timeout=60).status is JobStatus.SUCCEEDED
    report.update(accepted=60, completed=60, lost=0, outage_s=1.0,
                  all_done_after_s=round(recovery_s, 2))
    client.close()
    r.close()


def _celery_on(celery_workers: Any, settings: Any, node: str) -> Any:
    """celery_workers is bound to the session Redis; point this one at another."""
    return celery_workers(node, TOKENFLEET_REDIS_URL=settings.redis_url, wait=False)


def test_a_drained_worker_finishes_or_hands_back_its_jobs(
    settings: Any, client: FleetClient, celery_workers: Any, r: redis.Redis,
    report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    job_ids = [client.submit(f"drain {i}", max_new_tokens=300, temperature=0.0,
                             require_worker=False) for i in range(24)]
    consumers, seen = follow_all(settings, job_ids)
    first = celery_workers("cpu@leaving", TOKENFLEET_MAX_BATCH="8", TOKENFLEET_DRAIN_GRACE_S="0.5")
    wait_until(lambda: r.hget(keys.job(job_ids[0]), "first_token_at"), timeout=60,
               what="the first worker to start generating")
    assert first.stop(timeout=60) == 0  # SIGTERM: Celery's warm shutdown
    handed_back = sum(1 for j in job_ids if r.hget(keys.job(j), "handbacks"))
    celery_workers("cpu@staying", TOKENFLEET_MAX_BATCH="16")
    states = [client.wait(j, timeout=180) for j in job_ids]
    consumers.join(timeout=60)
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 24
    assert handed_back > 0 and "handed" in first.output()
    for state in states:
        assert logged_tokens(r, keys, state.id) == (state.token_ids, 0, True)
        assert stream_fault(seen[state.id], state) == "", state.id
    report.update(accepted=24, completed=24, lost=0, handed_back=handed_back)
