"""What a worker does with entries of jobs it already runs, and how a job resumes
from a token log with a gap.

- its own running entry, idle because no heartbeat touched it: its reclaim
  leaves it alone (not claimed again and again, not started a second time);
- a second entry for a job it runs: dropped at once as stale;
- a resumed job whose log has a gap: it resumes from the contiguous prefix and
  its final log is gap-free and equals its final token ids.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import GROUP, Keys, job_model
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.wire.serialization import loads, token_event
from tokenfleet.shared.wire.worker_scripts import log_entry_id
from tokenfleet.workers.runner import HFRunner

from helpers import logged_count, wait_until


@pytest.fixture
def settings(settings: Any) -> Any:
    """These tests queue their jobs before the worker that runs them starts."""
    return settings.model_copy(update={"require_worker": False})


pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]


class SlowRunner(HFRunner):
    """The real model at a big model's pace, so a job is still running while the test acts."""

    step_s = 0.05

    def run(self, batch):  # type: ignore[no-untyped-def]
        time.sleep(self.step_s)  # simulated compute time, not synchronisation
        return super().run(batch)


def log_events(r: redis.Redis, keys: Keys, job_id: str) -> list[tuple[bytes, dict[str, Any]]]:
    return [(i, loads(f[b"e"])) for i, f in r.xrange(keys.out(job_id), "0-1",
                                                      "0-18446744073709551615")]


def test_a_workers_own_running_entry_is_not_reclaimed_by_it_when_it_goes_idle(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    # A heartbeat slower than the claim time: the running entry goes idle, and
    # the worker's reclaim pass (every claim_idle_s / 2) finds it many times.
    worker = start_worker(runner=SlowRunner(*loaded_tiny), max_batch=2, prefetch=0,
                          heartbeat_s=30, claim_idle_s=0.3)
    job_id = client.submit("drain 0", max_new_tokens=80, temperature=0.0)
    stream = keys.queue(job_model(job_id))  # the queue's, or its partition's
    wait_until(lambda: logged_count(r, keys, job_id) >= 40, timeout=60,
               what="40 tokens (some 2 s: several claim periods)")
    pending = r.xpending_range(stream, GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [worker.name.encode()]
    deliveries = pending[0]["times_delivered"]
    assert deliveries == 1, f"its own entry was claimed again {deliveries - 1} times"
    state = client.wait(job_id, timeout=60)
    assert state.status is JobStatus.SUCCEEDED and state.attempts == 1
    report.update(running_s=round(state.finished_at - state.started_at, 2),  # type: ignore[operator]
                  claim_idle_s=0.3, redeliveries_of_own_entry=deliveries - 1)


def test_a_second_entry_of_a_running_job_is_dropped_at_once_and_runs_nothing_twice(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
) -> None:
    keys = Keys(settings.namespace)
    start_worker(runner=SlowRunner(*loaded_tiny), max_batch=2, prefetch=2, claim_idle_s=0.3)
    job_id = client.submit("drain 0", max_new_tokens=200, temperature=0.0)
    stream = keys.queue(job_model(job_id))  # the queue's, or its partition's
    wait_until(lambda: logged_count(r, keys, job_id) >= 3, timeout=60, what="the job to run")
    (live, fields), = r.xrange(stream)
    copy = r.xadd(stream, {"data": fields[b"data"]})  # the same job, a second entry
    wait_until(lambda: not r.xrange(stream, copy, copy), timeout=10,
               what="the copy to be deleted")
    assert r.hget(keys.job(job_id), "status") == b"running"  # dropped while the job runs
    assert [p["message_id"] for p in r.xpending_range(stream, GROUP, "-", "+", 10)] == [live]
    state = client.wait(job_id, timeout=60)
    assert state.status is JobStatus.SUCCEEDED and state.attempts == 1
    assert r.xlen(stream) == 0 and r.xlen(keys.dlq(job_model(job_id))) == 0


def test_a_job_resumed_from_a_log_with_a_gap_continues_from_the_gap_and_its_log_stays_gap_free(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
) -> None:
    keys = Keys(settings.namespace)
    _model, tok = loaded_tiny
    job_id = client.submit("Once upon a time", max_new_tokens=12, temperature=0.0)
    stream = keys.queue(job_model(job_id))  # the queue's, or its partition's
    # Attempt 1 ran on a worker that died: its entry is pending with it, and it
    # logged tokens 0-2 and 5-6, not 3-4 (a log with a gap).
    r.xgroup_create(stream, GROUP, id="0")
    r.xreadgroup(GROUP, "dead@test", {stream: ">"}, count=1)
    r.hset(keys.job(job_id), mapping={"status": "running", "attempts": 1,
                                      "worker": "dead@test", "started_at": time.time()})
    written = tok(" there was a little dog", add_special_tokens=False)["input_ids"][:7]
    for i in (0, 1, 2, 5, 6):
        r.xadd(keys.out(job_id), {"e": token_event(i, [written[i]], [tok.decode([written[i]])])},
               id=f"0-{i + 1}")
    start_worker(claim_idle_s=0.2)
    state = client.wait(job_id, timeout=60)
    assert state.status is JobStatus.SUCCEEDED and state.attempts == 2
    assert len(state.token_ids) == 12 and state.token_ids[:3] == written[:3]
    events = log_events(r, keys, job_id)
    ends = [e["index"] + len(e["token_ids"]) for _, e in events]
    # Attempt 1's kept prefix at its ids, attempt 2's events in its own band.
    attempts = [1, 1, 1] + [2] * (len(events) - 3)
    assert [i for i, _ in events] == [log_entry_id(a, end).encode()
                                      for a, end in zip(attempts, ends)]
    assert [e["index"] for _, e in events] == [0, *ends[:-1]] and ends[-1] == 12
    assert [t for _, e in events for t in e["token_ids"]] == state.token_ids
    assert "".join(e["text"] for _, e in events) == state.text
    assert r.xrange(keys.out(job_id), "1-0", "1-0")  # its end, after the last token
