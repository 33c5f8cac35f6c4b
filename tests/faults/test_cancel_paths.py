"""A cancel keeps what was generated, on every path a job can take back to the
queue or to another worker, and frees its place in the queue.

- handed back by a drain (``Worker.stop(grace_s=0)`` mid-generation): queued again;
- left by a worker that stopped without handing back (as a killed one does) and
  reclaimed by another: the cancel flag is found when the job is taken again;
- resumed by another worker and cancelled while it runs there.

In each case the job ends ``cancelled`` with the text and token ids that its
token log holds, equal to what ``stream()`` delivered; the queue's length is
back to what is live, and a submit afterwards is not refused.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import GROUP, Keys
from tokenfleet.shared.wire.schemas import FinishReason, JobState, JobStatus, TokenEvent
from tokenfleet.shared.wire.serialization import loads
from tokenfleet.workers.runner import HFRunner

from helpers import logged_count, queue_parts, wait_until


@pytest.fixture
def settings(settings: Any) -> Any:
    """These tests queue their jobs before the worker that runs them starts."""
    return settings.model_copy(update={"require_worker": False})


pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

MAX_QUEUE = 4


class SlowRunner(HFRunner):
    """The real model at a big model's pace, so jobs are mid-generation when the test acts."""

    step_s = 0.05

    def run(self, batch):  # type: ignore[no-untyped-def]
        time.sleep(self.step_s)  # simulated compute time, not synchronisation
        return super().run(batch)


class Followers:
    """One ``stream()`` consumer per job, each on a thread with a client of its own."""

    def __init__(self, settings: Any, job_ids: list[str]) -> None:
        self.seen: dict[str, list[TokenEvent]] = {j: [] for j in job_ids}
        self._threads = [threading.Thread(target=self._follow, args=(settings, j), daemon=True)
                         for j in job_ids]
        for thread in self._threads:
            thread.start()

    def _follow(self, settings: Any, job_id: str) -> None:
        with FleetClient(settings=settings) as c:
            for event in c.stream(job_id, timeout=90):
                self.seen[job_id].append(event)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a stream() never ended"

    def text(self, job_id: str) -> str:
        return "".join(e.text for e in self.seen[job_id])

    def token_ids(self, job_id: str) -> list[int]:
        return [t for e in self.seen[job_id] for t in e.token_ids]


def logged(r: redis.Redis, keys: Keys, job_id: str) -> list[int]:
    """The token ids in the job's log, in order."""
    entries = r.xrange(keys.out(job_id), "0-1", "0-18446744073709551615")
    return [t for _, f in entries for t in loads(f[b"e"])["token_ids"]]


@pytest.fixture
def small_client(settings: Any) -> Any:
    """A client whose model queue holds at most MAX_QUEUE jobs waiting or running."""
    with FleetClient(settings=settings.model_copy(update={"max_queue": MAX_QUEUE})) as c:
        yield c


def start_jobs(client: FleetClient, start_worker: Any, loaded_tiny: Any, settings: Any,
               r: redis.Redis, n: int, name: str) -> tuple[Any, list[str], Followers]:
    """n long jobs running on a fresh worker, each with a few tokens streamed."""
    keys = Keys(settings.namespace)
    job_ids = [client.submit(f"drain {i}", max_new_tokens=300, temperature=0.0) for i in range(n)]
    followers = Followers(settings, job_ids)
    worker = start_worker(name, runner=SlowRunner(*loaded_tiny), max_batch=n, prefetch=0)
    for job_id in job_ids:
        wait_until(lambda: logged_count(r, keys, job_id) >= 5, timeout=60,
                   what=f"job {job_id} to stream 5 tokens")
    return worker, job_ids, followers


def check_kept(state: JobState, followers: Followers, r: redis.Redis, keys: Keys) -> None:
    assert state.status is JobStatus.CANCELLED and state.finish_reason is FinishReason.CANCELLED
    assert len(state.token_ids) >= 5
    assert state.token_ids == followers.token_ids(state.id) == logged(r, keys, state.id)
    assert state.text == followers.text(state.id)


def check_queue_is_free(small_client: FleetClient, r: redis.Redis, keys: Keys) -> None:
    for part in queue_parts(r, keys):
        stream = keys.queue(part)
        assert r.xlen(stream) == 0 and r.xpending(stream, GROUP)["pending"] == 0
    # Nothing live: a full queue's worth of submits is accepted.
    for i in range(MAX_QUEUE):
        small_client.submit(f"after {i}", max_new_tokens=2)


def test_a_job_handed_back_by_a_drain_then_cancelled_keeps_its_streamed_text(
    small_client: FleetClient, start_worker: Any, loaded_tiny: Any, settings: Any,
    r: redis.Redis, report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    worker, job_ids, followers = start_jobs(small_client, start_worker, loaded_tiny, settings,
                                            r, MAX_QUEUE, "w1@test")
    worker.stop(grace_s=0)  # mid-generation: every job goes back to the queue
    assert [r.hget(keys.job(j), "status") for j in job_ids] == [b"queued"] * MAX_QUEUE
    # The hand-backs' new entries.
    assert sum(r.xlen(keys.queue(p)) for p in queue_parts(r, keys)) == MAX_QUEUE
    assert all(small_client.cancel(j) for j in job_ids)
    followers.join()
    states = [small_client.wait(j, timeout=10) for j in job_ids]
    for state in states:
        check_kept(state, followers, r, keys)
    check_queue_is_free(small_client, r, keys)
    report.update(jobs=MAX_QUEUE, handed_back=MAX_QUEUE, cancelled=len(states),
                  tokens_kept=sum(len(s.token_ids) for s in states), lost_tokens=0,
                  queue_len_after=0, refused_after=0)


def test_a_job_reclaimed_from_a_stopped_worker_then_cancelled_keeps_its_streamed_text(
    small_client: FleetClient, start_worker: Any, loaded_tiny: Any, settings: Any,
    r: redis.Redis, report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    n = 3
    worker, job_ids, followers = start_jobs(small_client, start_worker, loaded_tiny, settings,
                                            r, n, "w1@test")
    # Stopped without a hand-back, as a killed worker or one whose Redis was
    # away: its jobs stay running, their entries pending with it.
    worker.publisher.hand_back = lambda seqs, suspects=frozenset(): 0
    worker.stop(grace_s=0)
    # Asked for, not yet done: no one runs them now, so cancel() says False.
    assert not any(small_client.cancel(j, timeout=0) for j in job_ids)
    assert [r.hget(keys.job(j), "cancel") for j in job_ids] == [b"1"] * n
    stopped_at = time.monotonic()
    start_worker("w2@test", claim_idle_s=0.5)  # reclaims them and finds the cancels
    followers.join()
    states = [small_client.wait(j, timeout=30) for j in job_ids]
    for state in states:
        check_kept(state, followers, r, keys)
        assert state.attempts == 2 and state.worker == "w2@test"
    check_queue_is_free(small_client, r, keys)
    report.update(jobs=n, reclaimed=n, cancelled=len(states),
                  tokens_kept=sum(len(s.token_ids) for s in states), lost_tokens=0,
                  ended_after_s=round(time.monotonic() - stopped_at, 2), queue_len_after=0)


def test_a_resumed_job_cancelled_while_it_runs_keeps_every_streamed_token(
    small_client: FleetClient, start_worker: Any, loaded_tiny: Any, settings: Any,
    r: redis.Redis,
) -> None:
    keys = Keys(settings.namespace)
    worker, job_ids, followers = start_jobs(small_client, start_worker, loaded_tiny, settings,
                                            r, 1, "w1@test")
    job_id = job_ids[0]
    worker.publisher.hand_back = lambda seqs, suspects=frozenset(): 0
    worker.stop(grace_s=0)
    before = logged_count(r, keys, job_id)
    start_worker("w2@test", runner=SlowRunner(*loaded_tiny), claim_idle_s=0.5)
    wait_until(lambda: logged_count(r, keys, job_id) >= before + 5, timeout=30,
               what="the second worker to resume the job")
    assert small_client.cancel(job_id)
    followers.join()
    state = small_client.wait(job_id, timeout=10)
    check_kept(state, followers, r, keys)
    assert state.attempts == 2 and len(state.token_ids) >= before + 5
    check_queue_is_free(small_client, r, keys)
