"""A worker killed (kill -9) while a client streams its job, with a live peer
of another name (a new pod's): the peer takes the job as soon as the dead
worker's liveness lapses, not after ``claim_idle_s``, and the stream goes on.

Default settings on both workers (a heartbeat of 2 s, so liveness lapses 10 s
after the last beat; ``claim_idle_s`` 30 s): only the engine is the gpu-sim one
(a step of 50 ms, no model to load), so the job runs long enough to be killed
mid-way.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.client.fleet import fleet_status
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import JobStatus

from helpers import logged_count, stream_fault, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(240)]

# The bound the issue set: liveness lapse (10 s) and one resume, with room.
FIRST_TOKEN_AFTER_KILL_S = 15.0


def sim_worker(celery_workers: Any, node: str) -> Any:
    """A gpu-sim worker with the fleet's default heartbeat, block and claim times."""
    return celery_workers(node, TOKENFLEET_ENGINE="gpu-sim", TOKENFLEET_GPU_SIM_STEP_MS="50",
                          TOKENFLEET_HEARTBEAT_S="2", TOKENFLEET_BLOCK_MS="200",
                          TOKENFLEET_COALESCE_MS="0")


def test_a_killed_workers_stream_resumes_on_a_peer_once_its_liveness_lapses(
    client: FleetClient, celery_workers: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any],
) -> None:
    assert settings.claim_idle_s == 30.0  # the default: not what brings the job back
    keys = Keys(settings.namespace)
    workers = {node: sim_worker(celery_workers, node) for node in ("cpu@old-pod", "cpu@new-pod")}
    job_id = client.submit("a long story", max_new_tokens=1000)

    arrivals: list[tuple[float, Any]] = []  # (when it reached the client, event)
    done = threading.Event()

    def follow() -> None:
        with FleetClient(settings=settings) as c:
            for event in c.stream(job_id, timeout=200):
                arrivals.append((time.monotonic(), event))
        done.set()

    threading.Thread(target=follow, daemon=True).start()
    # Placed, not timed: the job is in flight once its first tokens reached the client.
    wait_until(lambda: len(arrivals) >= 3, timeout=60, what="the job's first tokens")
    holder = r.hget(keys.job(job_id), "worker").decode()
    workers[holder].kill()
    killed_at = time.monotonic()
    # Every token the dead worker logged may still be on its way; the first
    # one past them is the peer's.
    logged = logged_count(r, keys, job_id)

    def resumed() -> Any:
        return next((at for at, e in arrivals if e.index >= logged), None)

    wait_until(resumed, timeout=60, what="a token after the kill")
    silence_s = resumed() - killed_at
    # The peer took the job: its record and the fleet view say the killed one is gone.
    [peer] = set(workers) - {holder}
    assert r.hget(keys.job(job_id), "worker").decode() == peer
    view = fleet_status(client)
    assert [w["name"] for w in view["workers"] if w["live"]] == [peer]
    assert [q["workers"] for q in view["queues"]] == [1]
    assert silence_s < FIRST_TOKEN_AFTER_KILL_S, silence_s

    assert done.wait(120)
    state = client.wait(job_id, timeout=30)
    assert state.status is JobStatus.SUCCEEDED and state.attempts == 2
    assert stream_fault([e for _at, e in arrivals], state) == ""
    report.update(first_token_after_kill_s=round(silence_s, 2), tokens_before_kill=logged)
