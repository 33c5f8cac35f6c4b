"""A worker on a host whose clock is a minute off, behind or ahead.

Every time one process writes and another judges (a worker's ``alive_until``,
a job's ``deadline_at``, ``finished_at``) is on Redis's clock, so the worker is
live for submit and ``tokenfleet status``, its jobs run, and a deadline ends a
job when Redis's clock passes it. The worker is a child process whose
``time.time()`` is shifted (``skewed_clock/sitecustomize.py``); every time the
test compares is read from Redis's records, none from the test's own clock."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.client.fleet import fleet_status
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]

SKEWED_CLOCK = Path(__file__).parent / "skewed_clock"


def skewed_worker(celery_workers: Any, node: str, skew_s: float) -> Any:
    """A gpu-sim worker (a step of 10 ms, no model to load) whose wall clock is
    ``skew_s`` seconds off."""
    path = os.pathsep.join(p for p in (str(SKEWED_CLOCK), os.environ.get("PYTHONPATH")) if p)
    return celery_workers(node, TOKENFLEET_ENGINE="gpu-sim", TOKENFLEET_GPU_SIM_STEP_MS="10",
                          TOKENFLEET_TEST_CLOCK_SKEW_S=repr(skew_s), PYTHONPATH=path)


def redis_now(r: redis.Redis) -> float:
    seconds, micros = r.time()
    return seconds + micros / 1e6


@pytest.mark.parametrize("skew_s", [-60.0, 60.0], ids=["behind", "ahead"])
def test_a_worker_whose_clock_is_a_minute_off_serves_and_honours_deadlines(
    client: FleetClient, celery_workers: Any, r: redis.Redis, settings: Any, skew_s: float,
    report: dict[str, Any],
) -> None:
    keys, node = Keys(settings.namespace), "cpu@skewed"
    worker = skewed_worker(celery_workers, node, skew_s)
    # Its heartbeat speaks Redis's time, not its host's.
    last_seen = float(r.hget(keys.worker(node), "last_seen") or 0)
    assert abs(last_seen - redis_now(r)) < 10, worker.output()

    # Live: served, shown live, and a submit that needs a live worker succeeds.
    assert client.served_queues() == ["default"]
    assert [(q["queue"], q["workers"]) for q in fleet_status(client)["queues"]] == [("default", 1)]
    far = client.submit("a deadline far off", max_new_tokens=8, deadline_s=30)
    assert client.wait(far, timeout=60).status is JobStatus.SUCCEEDED, worker.output()

    # A deadline that passes while the job runs (1,000 steps of 10 ms) ends it
    # then, as Redis's clock tells.
    near = client.submit("a deadline mid-run", max_new_tokens=1000, deadline_s=1.0)
    state = client.wait(near, timeout=30)
    assert state.finish_reason is FinishReason.DEADLINE, (state, worker.output())
    assert state.started_at is not None and state.deadline_at is not None
    assert state.finished_at is not None and state.token_ids
    late_s = state.finished_at - state.deadline_at
    report.update(tokens=len(state.token_ids), ended_after_deadline_ms=round(late_s * 1000, 1))
    assert state.started_at < state.deadline_at  # it ran before its deadline...
    # ...and ended at it, not at its length: a worker on its own clock would run
    # all 1,000 steps (behind) or none (ahead). How late past the deadline it
    # stopped is a figure for the report, not a pass/fail line.
    assert late_s >= 0
    assert 0 < len(state.token_ids) < 1000
