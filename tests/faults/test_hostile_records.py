"""Hostile records at the intake: an entry that cannot be started is
dead-lettered alone with its reason, and the rest of the read runs.

- job records with an unknown status, a non-integer ``attempts``, or a key that
  is a string instead of a hash, read in the same XREADGROUP as good jobs;
- a record with no status, one gone, one with an ``attempts`` of 16 digits;
- an unexpected error while admitting one entry of a read.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import GROUP, Keys, level_queue
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.wire.serialization import loads
from tokenfleet.workers.admission import Admission

from helpers import dead_letters, queue_parts, wait_until


@pytest.fixture
def settings(settings: Any) -> Any:
    """These tests queue their jobs before the worker that runs them starts."""
    return settings.model_copy(update={"require_worker": False})


pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]


def high_streams(r: redis.Redis, keys: Keys) -> list[str]:
    """The high level's stream of the queue (of each partition: ``--partitions``)."""
    return [keys.queue(level_queue(part, "high")) for part in queue_parts(r, keys)]


def queue_is_empty(r: redis.Redis, keys: Keys) -> bool:
    """Nothing left on the high level to deliver or redeliver."""
    return all(r.xlen(s) == 0 and r.xpending(s, GROUP)["pending"] == 0
               for s in high_streams(r, keys))


def test_three_hostile_records_in_one_read_are_dead_lettered_alone_and_ten_good_jobs_succeed(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    # All on the high level: with 36 credits the feeder asks it for 21 entries,
    # so the 13 jobs come in one XREADGROUP (one start.lua call).
    good = [client.submit(f"good job {i}", max_new_tokens=6, priority="high") for i in range(10)]
    hostile = [client.submit(f"hostile {i}", max_new_tokens=6, priority="high") for i in range(3)]
    unknown, not_int, not_hash = hostile
    r.hset(keys.job(unknown), "status", "paused")
    r.hset(keys.job(not_int), "attempts", "two")
    r.delete(keys.job(not_hash))
    r.set(keys.job(not_hash), "not a hash")
    assert sum(r.xlen(s) for s in high_streams(r, keys)) == 13

    started = time.monotonic()
    worker = start_worker(max_batch=32, prefetch=4, claim_idle_s=2.0)
    states = [client.wait(j, timeout=60) for j in good]
    done_s = time.monotonic() - started

    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 10
    assert all(s.attempts == 1 for s in states)
    wait_until(lambda: len(dead_letters(r, keys)) >= 3, timeout=10, what="three dead letters")
    dead = dead_letters(r, keys)
    reasons = {d.get("job_id") or loads(d["entry"]["data"])["job_id"]: d["reason"] for d in dead}
    assert len(dead) == 3, dead
    assert "unknown status 'paused'" in reasons[unknown]
    assert "attempts is not an integer" in reasons[not_int]
    assert "not a hash" in reasons[not_hash] and "string" in reasons[not_hash]
    # Each hostile entry is off the queue for good: nothing left to redeliver.
    assert queue_is_empty(r, keys)
    # The two records that are hashes say that their job failed, and why.
    for job_id in (unknown, not_int):
        record = r.hgetall(keys.job(job_id))
        assert record[b"status"] == b"failed" and record[b"error"].decode() == reasons[job_id]
    assert client.wait(unknown, timeout=10).status is JobStatus.FAILED
    assert r.get(keys.job(not_hash)) == b"not a hash"  # not ours to overwrite
    # The worker serves on.
    after = client.submit("after the hostile read", max_new_tokens=4)
    assert client.wait(after, timeout=30).status is JobStatus.SUCCEEDED
    assert all(t.is_alive() for t in worker.threads)
    report.update(good=10, succeeded=10, hostile=3, dead_lettered=len(dead), stuck=0,
                  all_good_done_s=round(done_s, 2))


def test_a_record_without_status_one_gone_and_an_attempt_count_too_long_in_one_read(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any],
) -> None:
    # The intake reads a record with one HMGET and looks further only when that
    # read is odd: a hash with no status is still a hash (a failed job, its
    # reason), no key at all is a record gone (its entry dead-lettered). An
    # attempt count longer than a Lua number holds exactly (it would come back
    # to the worker rounded, and fence off its own run) fails its job. The good
    # jobs of the same read run.
    keys = Keys(settings.namespace)
    good = [client.submit(f"good job {i}", max_new_tokens=4, priority="high") for i in range(4)]
    no_status, gone, too_long = (client.submit(f"odd {i}", max_new_tokens=4, priority="high")
                                 for i in range(3))
    r.hdel(keys.job(no_status), "status")
    r.delete(keys.job(gone))
    r.hset(keys.job(too_long), "attempts", "1234567890123456")

    start_worker(max_batch=32, prefetch=4, claim_idle_s=2.0)
    assert [client.wait(j, timeout=60).status for j in good] == [JobStatus.SUCCEEDED] * 4
    wait_until(lambda: len(dead_letters(r, keys)) >= 3, timeout=10, what="three dead letters")
    reasons = {(d.get("job_id") or loads(d["entry"]["data"])["job_id"]): d["reason"]
               for d in dead_letters(r, keys)}
    assert reasons[no_status] == "job record has no status"
    assert "no job record" in reasons[gone]
    assert "attempts is not an integer of at most 15 digits" in reasons[too_long]
    for job_id in (no_status, too_long):
        assert client.status(job_id).status is JobStatus.FAILED
    assert r.hget(keys.job(too_long), "attempts") == b"1234567890123456"  # left as found
    assert queue_is_empty(r, keys)
    report.update({"good": 4, "dead_lettered": 3})


def test_an_error_admitting_one_entry_fails_that_job_alone(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = Keys(settings.namespace)
    job_ids = [client.submit(f"batch {i}", max_new_tokens=5, priority="high") for i in range(6)]
    poisoned = job_ids[2]
    sequence = Admission.sequence

    def admit(self: Admission, entry: Any, entry_id: str, attempt: int) -> Any:
        if entry.job_id == poisoned:
            raise RuntimeError("tokenizer crashed (simulated)")
        return sequence(self, entry, entry_id, attempt)

    monkeypatch.setattr(Admission, "sequence", admit)  # before the worker's first read
    start_worker(max_batch=32, prefetch=4)
    states = {j: client.wait(j, timeout=60) for j in job_ids}
    bad = states.pop(poisoned)
    assert bad.status is JobStatus.FAILED and "tokenizer crashed" in (bad.error or "")
    assert all(s.status is JobStatus.SUCCEEDED for s in states.values())
    assert [d["job_id"] for d in dead_letters(r, keys)] == [poisoned]
    assert all(r.xlen(s) == 0 for s in high_streams(r, keys))
