"""The worker's one stop path: it ends every thread and the metrics server; it
never hands back a job that an engine thread which did not end may still run;
and steps that keep raising stop the worker as a failed device does, after
showing in its heartbeat."""

from __future__ import annotations

import logging
import socket
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import GROUP, Keys
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.wire.serialization import loads
from tokenfleet.workers import service
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import StepBatch

from helpers import direct_greedy, free_port, queue_parts, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(240)]


@pytest.fixture
def settings(settings: Any) -> Any:
    """These tests queue their jobs before the worker that runs them starts."""
    return settings.model_copy(update={"require_worker": False})


class HangingRunner(HFRunner):
    """The real model, whose forward pass after ``good_steps`` does not return
    until the test releases it: a hung device."""

    def __init__(self, loaded: tuple[Any, Any], good_steps: int) -> None:
        super().__init__(*loaded)
        self.good_steps, self.steps = good_steps, 0
        self.hung, self.release = threading.Event(), threading.Event()

    def run(self, batch: StepBatch) -> list[int]:
        self.steps += 1
        if self.steps > self.good_steps:
            self.hung.set()
            self.release.wait(120)
        return super().run(batch)


class MalformedRunner(HFRunner):
    """The real model, until ``broken`` is set after ``good_steps``: then a
    decode step returns no token, a bug the engine trips on outside the forward
    pass it retries."""

    def __init__(self, loaded: tuple[Any, Any], good_steps: int) -> None:
        super().__init__(*loaded)
        self.good_steps, self.steps = good_steps, 0
        self.broken = threading.Event()

    def run(self, batch: StepBatch) -> list[int]:
        self.steps += 1
        if self.steps == self.good_steps + 1:
            self.broken.set()
        if self.broken.is_set():
            return self.broken_run(batch)
        return super().run(batch)

    def broken_run(self, batch: StepBatch) -> list[int]:
        return [] if not batch.is_prefill else super().run(batch)


class FailingForwardRunner(MalformedRunner):
    """While broken, the forward pass raises: a failure the engine recovers
    from itself, retrying the step."""

    def broken_run(self, batch: StepBatch) -> list[int]:
        raise RuntimeError("the forward pass failed")


JOBS = [(f"the worker stops {i}", 30) for i in range(3)]


def submit(client: FleetClient) -> list[str]:
    return [client.submit(p, max_new_tokens=n, temperature=0.0) for p, n in JOBS]


def completed(client: FleetClient, job_ids: list[str], loaded: Any) -> list[Any]:
    states = [client.wait(j, timeout=120) for j in job_ids]
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * len(job_ids)
    assert [s.text for s in states] == direct_greedy(loaded, JOBS)
    return states


def test_stop_ends_every_thread_and_the_metrics_server(start_worker: Any) -> None:
    port = free_port()
    worker = start_worker(metrics_port=port)
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()

    worker.stop(grace_s=0)
    assert not any(t.is_alive() for t in worker.threads)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    with socket.socket() as s:  # nothing listens there any more
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))


def test_a_stop_whose_engine_thread_does_not_end_hands_back_nothing_it_may_still_run(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    keys = Keys(settings.namespace)
    monkeypatch.setattr(service, "JOIN_S", 0.5)
    job_ids = submit(client)
    runner = HangingRunner(loaded_tiny, good_steps=5)
    request.addfinalizer(runner.release.set)
    stuck = start_worker("stuck@test", runner=runner)
    assert runner.hung.wait(60), "the forward pass never hung"

    with caplog.at_level(logging.ERROR, logger=service.__name__):
        stuck.stop(grace_s=0)
    assert "none is handed back" in caplog.text
    assert any(t.is_alive() for t in stuck.threads), "the engine thread was to be still running"
    # Every job is still the stuck worker's first attempt, its entry pending with it...
    assert [r.hget(keys.job(j), "status") for j in job_ids] == [b"running"] * 3
    assert sum(c["pending"] for p in queue_parts(r, keys)
               for c in r.xinfo_consumers(keys.queue(p), GROUP)
               if c["name"] == b"stuck@test") == 3
    # ...and the worker left the fleet: no heartbeat renews its entries.
    assert not r.exists(keys.worker("stuck@test"))

    runner.release.set()  # the step returns; whatever it writes is fenced or resumed from
    start_worker("healthy@test", claim_idle_s=1)  # reclaims them as a dead worker's
    states = completed(client, job_ids, loaded_tiny)
    assert all(s.attempts == 2 and s.worker == "healthy@test" for s in states)


def test_a_step_error_that_repeats_stops_the_worker_as_a_failed_device_does(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
) -> None:
    keys = Keys(settings.namespace)
    job_ids = submit(client)
    runner = MalformedRunner(loaded_tiny, good_steps=5)
    broken = start_worker("broken@test", runner=runner, max_failed_steps=3)
    assert broken.fatal.wait(60), "the worker did not give up"

    assert "3 steps failed in a row" in broken.fatal_reason
    assert "ValueError" in broken.fatal_reason
    assert broken.engine.stats.failed_steps == 3
    assert not any(t.is_alive() for t in broken.threads)
    # Handed back, each counted as an attempt (one of them may be the cause).
    assert [r.hget(keys.job(j), "status") for j in job_ids] == [b"queued"] * 3
    assert not r.exists(keys.worker("broken@test"))

    start_worker("healthy@test")
    completed(client, job_ids, loaded_tiny)


def failing_shown(start_worker: Any, r: redis.Redis, settings: Any, name: str,
                  runner: MalformedRunner) -> tuple[Any, str, bytes]:
    """Start a worker on ``runner`` that never gives up, and wait until its
    heartbeat's ``failing`` field says something: (worker, its key, the field)."""
    worker = start_worker(name, runner=runner, max_failed_steps=100_000)
    key = Keys(settings.namespace).worker(name)
    failing = wait_until(lambda: r.hget(key, "failing"), timeout=60,
                         what="the failing steps in the heartbeat")
    assert r.hget(key, "fatal") == b""
    return worker, key, failing


def test_a_step_error_shows_in_the_heartbeat_until_a_step_succeeds(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
) -> None:
    job_ids = submit(client)
    runner = MalformedRunner(loaded_tiny, good_steps=3)
    worker, key, failing = failing_shown(start_worker, r, settings, "failing@test", runner)
    assert b"failed in a row, the last with ValueError" in failing
    assert loads(r.hget(key, "stats") or b"{}")["failed_steps"] >= 1

    runner.broken.clear()  # the steps succeed again: the jobs finish, the heartbeat clears
    completed(client, job_ids, loaded_tiny)
    wait_until(lambda: r.hget(key, "failing") == b"", timeout=30, what="the heartbeat to clear")
    assert not worker.fatal.is_set()


def test_forward_passes_the_engine_retries_show_in_the_heartbeat_until_one_succeeds(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
) -> None:
    job_ids = submit(client)
    runner = FailingForwardRunner(loaded_tiny, good_steps=3)
    worker, key, failing = failing_shown(start_worker, r, settings, "retrying@test", runner)
    assert b"failed forward pass(es) retried by the engine" in failing

    # The first jobs end as the engine's retries decide (their failures count
    # as attempts); once the forward passes succeed again, new jobs complete.
    for job_id in job_ids:
        assert client.wait(job_id, timeout=120).status.is_terminal
    runner.broken.clear()
    completed(client, submit(client), loaded_tiny)
    wait_until(lambda: r.hget(key, "failing") == b"", timeout=30, what="the heartbeat to clear")
    assert not worker.fatal.is_set()
