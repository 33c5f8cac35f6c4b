"""A zombie worker: frozen (SIGSTOP) past its claim while another worker takes its
jobs, then woken (SIGCONT) in the middle of them. Its writes are fenced by the
log entry ids alone (no read of the job record per event): once the new
attempt has resumed a job, every token write of the old one is refused, so the
zombie logs nothing more, each token is logged once, and a consumer streaming
the job throughout gets every token once.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.wire.worker_scripts import LOG_BAND
from tokenfleet.workers.runner import HFRunner

from helpers import direct_greedy, follow_all, logged_count, logged_tokens, stream_fault, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(150)]

CLAIM_IDLE_S = 2.0


def first_attempt_entries(r: redis.Redis, keys: Keys, job_id: str) -> int:
    """How many entries of the job's log the first attempt wrote (its band)."""
    return len(r.xrange(keys.out(job_id), "-", f"(0-{LOG_BAND}"))


class SlowFirstStep(HFRunner):
    """The real model, whose first step takes a while (a big model's prefill):
    the jobs it took are resumed (fenced) and nothing of its own is written yet,
    so whatever the woken worker writes then would land, but for the fence."""

    first_step_s = 3.0

    def run(self, batch):  # type: ignore[no-untyped-def]
        if self.first_step_s:
            time.sleep(self.first_step_s)  # simulated compute time, not synchronisation
            self.first_step_s = 0.0
        return super().run(batch)


def test_a_worker_woken_after_its_jobs_were_taken_writes_nothing_to_their_logs(
    client: FleetClient, celery_workers: Any, start_worker: Any, r: redis.Redis,
    settings: Any, loaded_tiny: Any, report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    zombie = celery_workers("zombie@test", TOKENFLEET_CLAIM_IDLE_S=str(CLAIM_IDLE_S),
                            TOKENFLEET_COALESCE_MS="0")
    work = [(f"Once upon a time {i}", 300) for i in range(3)]
    job_ids = [client.submit(p, max_new_tokens=n, temperature=0.0) for p, n in work]
    consumers, seen = follow_all(settings, job_ids)
    wait_until(lambda: all(logged_count(r, keys, j) >= 10 for j in job_ids), timeout=60,
               what="every job to log 10 tokens on the first worker")

    os.kill(zombie.proc.pid, signal.SIGSTOP)
    try:
        frozen_at = {j: logged_count(r, keys, j) for j in job_ids}
        # Its entries go idle (its heartbeat is frozen too): another worker
        # reclaims them after claim_idle_s, resumes each job (the fence) and
        # goes on writing in the second attempt's band.
        taker = start_worker("taker@test", runner=SlowFirstStep(*loaded_tiny),
                             claim_idle_s=CLAIM_IDLE_S, coalesce_ms=0)
        # A job reaches the taker's engine once resumed (intake.py): fenced.
        wait_until(lambda: {s.job_id for s in taker.engine.unfinished()} == set(job_ids),
                   timeout=60, what="the second worker to resume every job")
        fenced_at = {j: first_attempt_entries(r, keys, j) for j in job_ids}
    finally:
        os.kill(zombie.proc.pid, signal.SIGCONT)

    # Woken, the zombie runs its next steps as if nothing happened: its writes
    # are refused and it drops each job (what it logs when it learns so).
    wait_until(lambda: all(f"dropping job {j} here: a newer attempt owns it" in zombie.output()
                           for j in job_ids),
               timeout=60, what="the woken worker to learn that it lost every job")
    states = [client.wait(j, timeout=90) for j in job_ids]
    consumers.join(timeout=30)

    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 3
    assert all(s.attempts >= 2 for s in states)
    # Nothing of the first attempt after the fence: its band is as the resume left it.
    assert {j: first_attempt_entries(r, keys, j) for j in job_ids} == fenced_at
    for state in states:
        tokens, gaps, ended = logged_tokens(r, keys, state.id)
        assert (tokens, gaps, ended) == (state.token_ids, 0, True), state.id
    assert [s.text for s in states] == direct_greedy(loaded_tiny, work)
    assert {s.id: stream_fault(seen.get(s.id), s) for s in states} == dict.fromkeys(job_ids, "")
    assert zombie.proc.poll() is None, zombie.output()  # it lives on, having dropped them
    report.update(jobs=3, logged_at_freeze=sorted(frozen_at.values()),
                  first_attempt_entries=sorted(fenced_at.values()), zombie_writes_after_fence=0)
