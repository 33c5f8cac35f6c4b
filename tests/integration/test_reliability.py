"""Cancellation, deadlines, backpressure and idempotency on a real redis-server."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient, QueueFull
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus
from tokenfleet.workers.runner import HFRunner

from helpers import wait_until

pytestmark = pytest.mark.timeout(120)


class SlowRunner(HFRunner):
    """The real model, slowed to a big model's pace so a job outlives a deadline."""

    step_s = 0.02

    def run(self, batch):  # type: ignore[no-untyped-def]
        time.sleep(self.step_s)  # simulated compute time, not synchronisation
        return super().run(batch)


def test_cancelling_a_running_job_ends_it_within_a_step_and_frees_its_slot(
    client: FleetClient, start_worker: Any, loaded_tiny: Any
) -> None:
    worker = start_worker(runner=SlowRunner(*loaded_tiny), max_batch=1, prefetch=0)
    job_id = client.submit("A long story", max_new_tokens=1000, temperature=0.0)
    seen = []
    for event in client.stream(job_id, timeout=60):
        seen.append(event)
        if len(seen) == 3:
            assert client.cancel(job_id) is True
    state = client.wait(job_id, timeout=10)
    assert state.status is JobStatus.CANCELLED and state.finish_reason is FinishReason.CANCELLED
    assert state.text == "".join(e.text for e in seen)
    assert 3 <= len(state.token_ids) < 20  # it stopped within a few steps, not at 1000
    # The one slot is free again: the next job runs.
    nxt = client.submit("next", max_new_tokens=3)
    assert client.wait(nxt, timeout=30).status is JobStatus.SUCCEEDED
    assert worker.engine.stats.jobs == {"cancelled": 1, "succeeded": 1}


def test_a_job_still_queued_past_its_deadline_expires_without_touching_the_model(
    client: FleetClient, start_worker: Any
) -> None:
    job_id = client.submit("too late", max_new_tokens=5, deadline_s=0.05, require_worker=False)
    wait_until(lambda: time.time() > client.status(job_id).deadline_at, timeout=5,  # type: ignore[operator]
               what="the deadline to pass")
    worker = start_worker()
    state = client.wait(job_id, timeout=30)
    assert state.status is JobStatus.EXPIRED and state.finish_reason is FinishReason.DEADLINE
    assert state.token_ids == [] and state.num_prompt_tokens is None
    assert worker.engine.stats.tokens == 0


def test_a_running_job_stops_at_its_deadline_with_its_text_so_far(
    client: FleetClient, start_worker: Any, loaded_tiny: Any
) -> None:
    start_worker(runner=SlowRunner(*loaded_tiny))
    job_id = client.submit("Keep going", max_new_tokens=1000, temperature=0.0, deadline_s=0.5)
    streamed = "".join(e.text for e in client.stream(job_id, timeout=30))
    state = client.status(job_id)
    assert state.status is JobStatus.EXPIRED and state.finish_reason is FinishReason.DEADLINE
    assert 0 < len(state.token_ids) < 1000 and state.text == streamed


def test_a_full_queue_refuses_at_once_and_drops_nothing(
    settings: Any, r: redis.Redis
) -> None:
    with FleetClient(settings=settings.model_copy(update={"max_queue": 3,
                                                          "require_worker": False})) as small:
        accepted = [small.submit("fits", max_new_tokens=2) for _ in range(3)]
        # Refused from the count alone, with no worker to wait for: the pytest
        # timeout bounds a refusal that would wait for room.
        with pytest.raises(QueueFull, match="queue 'default' is full .*limit 3"):
            small.submit("one too many", max_new_tokens=2)
        assert r.xlen(Keys(settings.namespace).queue("default")) == 3
        assert all(small.status(j).status is JobStatus.QUEUED for j in accepted)


def test_the_same_idempotency_key_returns_the_same_job_which_runs_once(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    first = client.submit("charge the card", max_new_tokens=4, idempotency_key="order-42",
                          require_worker=False)
    again = client.submit("charge the card", max_new_tokens=4, idempotency_key="order-42",
                          require_worker=False)
    assert first == again
    assert r.xlen(Keys(settings.namespace).queue("default")) == 1
    start_worker()
    state = client.wait(first, timeout=30)
    assert state.status is JobStatus.SUCCEEDED and state.attempts == 1
    assert client.submit("charge the card", max_new_tokens=4, idempotency_key="order-42") == first
