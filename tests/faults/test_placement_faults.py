"""Placement by prefix under faults: the owner of a stream killed with SIGKILL while
it runs jobs placed on it. Its jobs, pending in its own stream, are reclaimed by
the other worker and resumed from their logs; those still waiting there are
taken over; none is lost, none runs twice, every text is the undisturbed one.
(The whole fault suite runs with placement on too: ``--affinity``.)"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import GROUP, Keys, owner_tag
from tokenfleet.shared.wire.schemas import JobStatus

from helpers import ChannelTally, direct_greedy, follow_all, stream_fault, wait_until
from placed_kill import frozen_mid_job

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

# A system prompt long enough to be matched on (TOKENFLEET_AFFINITY_MIN_CHARS, 128).
SYSTEM = ("the value of a list is returned when the module calls its function " * 4).strip()
PLACED = {"TOKENFLEET_AFFINITY": "true", "TOKENFLEET_MAX_BATCH": "8",
          "TOKENFLEET_CLAIM_IDLE_S": "2", "TOKENFLEET_AFFINITY_MIN_CHARS": "128"}


@pytest.mark.one_partition("reads the owners of the queue 'default' itself")
def test_kill_9_of_a_streams_owner_loses_nothing_and_runs_nothing_twice(
    settings: Any, celery_workers: Any, r: redis.Redis, loaded_tiny: Any,
    report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    placed = settings.model_copy(update={"affinity": True, "affinity_min_chars": 128})
    with FleetClient(settings=placed) as client:
        owner = celery_workers("cpu@owner", **PLACED)
        # The owner runs the system prompt first: it holds it.
        client.wait(client.submit(f"{SYSTEM}\nwarm", max_new_tokens=2), timeout=120)
        celery_workers("cpu@peer", **PLACED)
        jobs = [(f"{SYSTEM}\nquestion {i}", 96 + i % 8) for i in range(24)]
        job_ids = [client.submit(p, max_new_tokens=n, temperature=0.0) for p, n in jobs]
        tally = ChannelTally(settings.redis_url, keys, job_ids)
        consumers, seen = follow_all(placed, job_ids)
        tag = owner_tag("cpu@owner")
        on_owner = [j for j in job_ids if r.hget(keys.job(j), "owner") == tag.encode()]
        assert len(on_owner) >= 8  # a batch's worth placed on it before it counted as busy

        def own_running(running: list[str]) -> bool:
            return bool(set(running) & set(on_owner))

        with frozen_mid_job(owner.proc, r, keys, "cpu@owner", on_owner, own_running) as running:
            streams = [keys.queue(m.decode()) for m in r.smembers(keys.owned_levels("default"))]
            pending = sum(r.xpending(s, GROUP)["pending"] for s in streams)
            waiting = sum(r.xlen(s) for s in streams) - pending
            owner.kill()  # SIGKILL: its own stream's entries stay pending with it
        states = [client.wait(j, timeout=180) for j in job_ids]
        consumers.join(timeout=60)
        tally.wait_ended(job_ids, timeout=30)
        tally.close()

    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * len(jobs)
    resumed = {s.id for s in states if s.attempts > 1}
    assert resumed >= set(running) and set(running) & set(on_owner)
    assert {s.worker for s in states if s.id in resumed} == {"cpu@peer"}
    assert tally.ends_not_once(job_ids) == {}
    assert tally.duplicated == 0
    # The tally listens from just after the submits, and the owner may have sent a
    # job's first tokens by then: the streams from the start (below) see every one.
    assert sum(tally.tokens.values()) <= sum(len(s.token_ids) for s in states)
    for state in states:
        assert stream_fault(seen[state.id], state) == "", state.id
    assert [s.text for s in states] == direct_greedy(loaded_tiny, jobs)
    # Forgotten once its streams are empty: no job is placed on it again.
    wait_until(lambda: not r.hexists(keys.owners("default"), tag), timeout=30,
               what="the killed owner to be forgotten")
    report.update(accepted=len(jobs), placed_on_owner=len(on_owner),
                  pending_in_own_streams_at_kill=pending,
                  waiting_in_own_streams_at_kill=waiting, resumed=len(resumed), lost=0,
                  duplicated=tally.duplicated)


@pytest.mark.one_partition("reads the owners of the queue 'default' itself")
def test_a_frozen_owners_placed_jobs_are_taken_once_they_waited_the_steal_time(
    settings: Any, start_worker: Any, r: redis.Redis, report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    steal_ms = 300
    owner = start_worker("w1@test", affinity=True, affinity_steal_ms=steal_ms)
    placed = settings.model_copy(update={"affinity": True})
    with FleetClient(settings=placed) as client:
        client.wait(client.submit(f"{SYSTEM}\nwarm", max_new_tokens=2), timeout=60)
        peer = start_worker("w2@test", affinity=True, affinity_steal_ms=steal_ms)
        owner.paused.set()  # live, beating, reading nothing: its slots full, as far as peers see
        job_ids = [client.submit(f"{SYSTEM}\nquestion {i}", max_new_tokens=8, temperature=0.0)
                   for i in range(6)]
        assert {r.hget(keys.job(j), "owner") for j in job_ids} == {owner_tag(owner.name).encode()}
        states = [client.wait(j, timeout=60) for j in job_ids]
    assert {s.worker for s in states} == {peer.name} and all(s.attempts == 1 for s in states)
    waits = [(s.started_at or 0) - (s.created_at or 0) for s in states]
    # Never before the steal time; after it, within a blocking read and a step.
    assert min(waits) >= steal_ms / 1000
    assert max(waits) < steal_ms / 1000 + 1.0, waits
    report.update(steal_ms=steal_ms, stolen=len(states),
                  waited_ms_min=round(min(waits) * 1000), waited_ms_max=round(max(waits) * 1000))
