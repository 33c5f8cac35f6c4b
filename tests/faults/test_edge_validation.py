"""Edge cases of what a producer sends: a queue name with a trailing newline,
metadata that is not JSON, an idempotency key reused for another request, and a
cancel that races the job's completion. Each is refused or answered truthfully."""

from __future__ import annotations

import asyncio
import math
import random
import threading
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from tokenfleet import (AsyncFleetClient, FleetClient, IdempotencyConflict, InvalidRequest,
                        TokenfleetError)
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import GenerationRequest, JobStatus
from tokenfleet.shared.settings import Settings

from helpers import queue_parts, wait_until, written_keys

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]


def _keys_of(r: redis.Redis, namespace: str) -> list[bytes]:
    return written_keys(r, namespace)


@pytest.mark.parametrize("model", ["default\n", "default\r\n", "\ndefault", "a\nb", "default "])
def test_a_queue_name_with_a_newline_is_refused_and_nothing_is_written(
    client: FleetClient, r: redis.Redis, settings: Any, model: str
) -> None:
    # '^...$' with re.match let "default\n" through: its job waited for good
    # on a stream literally named "default\n" that no worker reads.
    with pytest.raises(InvalidRequest, match="model.*queue name") as info:
        client.submit("hi", model=model, require_worker=False)
    assert info.value.errors[0]["loc"] == ["model"]
    assert _keys_of(r, settings.namespace) == []


def test_a_worker_queue_name_with_a_newline_is_refused() -> None:
    with pytest.raises(ValidationError, match="queue must be"):
        Settings(queue="default\n")


@pytest.mark.parametrize("field", ["max_new_tokens", "top_k", "seed", "temperature", "top_p",
                                   "repetition_penalty", "deadline_s"])
@pytest.mark.parametrize("flag", [True, False])
def test_true_or_false_is_not_a_number_and_nothing_is_written(
    client: FleetClient, r: redis.Redis, settings: Any, field: str, flag: bool
) -> None:
    # pydantic takes true for 1: max_new_tokens=true ran a one-token job.
    with pytest.raises(InvalidRequest, match=f"not {str(flag).lower()}") as info:
        client.submit("hi", require_worker=False, **{field: flag})
    assert info.value.errors[0]["loc"][-1] == field
    assert _keys_of(r, settings.namespace) == []


@pytest.mark.parametrize(
    "metadata, where",
    [
        ({"tags": {"a", "b"}}, "metadata['tags'] is of type set"),
        ({"blob": b"\x00\x01"}, "metadata['blob'] is of type bytes"),
        ({"deep": {"x": [1, object()]}}, "metadata['deep']['x'][1] is of type object"),
        ({"score": math.nan}, "metadata['score'] is nan"),
        ({"n": 2**70}, "metadata['n'] is an integer outside the 64-bit range"),
        ({"s": "\ud800"}, "metadata['s'] is a string that is not valid UTF-8"),
        ({"k": {1: "x"}}, "metadata['k'] has a key 1"),
    ],
)
def test_metadata_that_is_not_json_is_a_validation_error_naming_metadata(
    client: FleetClient, r: redis.Redis, settings: Any, metadata: dict[str, Any], where: str
) -> None:
    # Before: orjson's bare TypeError from deep inside the size check.
    with pytest.raises(InvalidRequest, match=where.replace("[", r"\[").replace("]", r"\]")
                       ) as info:
        client.submit("hi", metadata=metadata, require_worker=False)
    assert info.value.errors[0]["loc"] == ["metadata"]
    assert _keys_of(r, settings.namespace) == []


def test_json_metadata_is_accepted_and_round_trips(client: FleetClient) -> None:
    metadata = {"user": "ann", "n": [1, 2.5, None, True], "nested": {"k": {"x": "é"}}}
    job_id = client.submit("hi", metadata=metadata, require_worker=False)
    assert client.status(job_id).metadata == metadata


def test_an_idempotency_key_reused_for_another_request_is_a_conflict(
    client: FleetClient, r: redis.Redis, settings: Any, report: dict[str, Any]
) -> None:
    ask = {"max_new_tokens": 4, "idempotency_key": "order-42", "require_worker": False}
    first = client.submit("charge the card", metadata={"a": 1, "b": 2}, **ask)
    # The same request again (metadata in another order is the same request): same job.
    assert client.submit("charge the card", metadata={"b": 2, "a": 1}, **ask) == first
    assert client.submit(GenerationRequest.model_validate(
        {"prompt": "charge the card", "sampling": {"max_new_tokens": 4},
         "metadata": {"a": 1, "b": 2}, "idempotency_key": "order-42"}),
        require_worker=False) == first
    others = [
        {"prompt": "refund the card"},
        {"prompt": "charge the card", "max_new_tokens": 5},
        {"prompt": "charge the card", "metadata": {"a": 1}},
        {"prompt": "charge the card", "priority": "high"},
    ]
    conflicts = 0
    for other in others:
        kwargs = {**ask, "metadata": {"a": 1, "b": 2}, **other}
        prompt = kwargs.pop("prompt")
        with pytest.raises(IdempotencyConflict, match="'order-42' was already used") as info:
            client.submit(prompt, **kwargs)
        # The other job's id is read and cancel access: the error must not give it away.
        assert first not in str(info.value)
        assert isinstance(info.value, TokenfleetError)
        conflicts += 1
    keys = Keys(settings.namespace)
    assert sum(r.xlen(keys.queue(p)) for p in queue_parts(r, keys)) == 1
    assert not r.exists(keys.queue("other"))
    assert len(list(r.scan_iter(match=keys.job("*")))) == 1
    # A key is its queue's (its keys share the queue's hash tag, for Redis Cluster):
    # on another queue the same key makes that queue's job, once.
    elsewhere = client.submit("charge the card", model="other", metadata={"a": 1, "b": 2}, **ask)
    assert elsewhere.startswith("other:") and elsewhere != first
    assert client.submit("charge the card", model="other", metadata={"b": 2, "a": 1},
                         **ask) == elsewhere
    report.update(same_request_same_id=3, other_requests_refused=conflicts)


async def test_the_async_client_refuses_an_idempotency_conflict_too(settings: Any) -> None:
    async with AsyncFleetClient(settings=settings) as c:
        first = await c.submit("a", idempotency_key="k", require_worker=False)
        assert await c.submit("a", idempotency_key="k", require_worker=False) == first
        with pytest.raises(IdempotencyConflict):
            await c.submit("b", idempotency_key="k", require_worker=False)


def _race_cancel_against_completion(client: FleetClient, rounds: int,
                                    rng: random.Random) -> dict[str, int]:
    """Submit short jobs and cancel each one as soon as it runs, so the cancel
    and the job's last steps race; compare cancel()'s answer with how it ended."""
    seen = {"rounds": rounds, "said_cancelled": 0, "ended_cancelled": 0,
            "ended_succeeded": 0, "mismatches": 0}
    for _ in range(rounds):
        job_id = client.submit("Once upon a time", max_new_tokens=rng.randint(1, 3),
                               temperature=0.0)
        wait_until(lambda: client.status(job_id).status is not JobStatus.QUEUED,
                   timeout=30, what="the job to start", interval=0.001)
        said = client.cancel(job_id)
        final = client.wait(job_id, timeout=30).status
        seen["said_cancelled"] += said
        seen["ended_cancelled"] += final is JobStatus.CANCELLED
        seen["ended_succeeded"] += final is JobStatus.SUCCEEDED
        seen["mismatches"] += said != (final is JobStatus.CANCELLED)
    return seen


def test_cancel_says_true_only_for_a_job_that_ended_cancelled(
    client: FleetClient, start_worker: Any, report: dict[str, Any]
) -> None:
    # Before: cancel() said True whenever the job was running when asked (11 of
    # 30 such jobs then ended 'succeeded').
    start_worker()
    seen = _race_cancel_against_completion(client, 30, random.Random(7))
    report.update(seen)
    assert seen["mismatches"] == 0, seen
    assert seen["ended_cancelled"] + seen["ended_succeeded"] == 30, seen


async def test_the_async_cancel_says_true_only_for_a_job_that_ended_cancelled(
    settings: Any, start_worker: Any, report: dict[str, Any]
) -> None:
    start_worker()
    rng = random.Random(11)
    mismatches = cancelled = 0
    async with AsyncFleetClient(settings=settings) as c:
        for _ in range(15):
            job_id = await c.submit("Once upon a time", max_new_tokens=rng.randint(1, 3),
                                    temperature=0.0)
            # Polls the record (no event marks the start); the test's timeout bounds it.
            while (await c.status(job_id)).status is JobStatus.QUEUED:
                await asyncio.sleep(0.001)
            said = await c.cancel(job_id)
            final = (await c.wait(job_id, timeout=30)).status
            cancelled += final is JobStatus.CANCELLED
            mismatches += said != (final is JobStatus.CANCELLED)
    report.update(rounds=15, ended_cancelled=cancelled, mismatches=mismatches)
    assert mismatches == 0


def test_cancel_of_a_running_job_that_outlasts_the_wait_says_false(
    client: FleetClient, start_worker: Any, loaded_tiny: Any
) -> None:
    """With no time to wait, a running job is not (yet) known to be cancelled."""
    from tokenfleet.workers.runner import HFRunner

    released = threading.Event()
    steps = 0

    class Stuck(HFRunner):
        def run(self, batch):  # type: ignore[no-untyped-def]
            # The first step runs (the job is running); the next waits until
            # the cancel has been asked, so the cancel lands between two steps.
            nonlocal steps
            steps += 1
            if steps > 1:
                assert released.wait(30), "the test never released the model"
            return super().run(batch)

    start_worker(runner=Stuck(*loaded_tiny))
    job_id = client.submit("Once upon a time", max_new_tokens=100)
    wait_until(lambda: client.status(job_id).status is JobStatus.RUNNING, timeout=30,
               what="the job to start")
    try:
        assert client.cancel(job_id, timeout=0) is False
    finally:
        released.set()
    assert client.wait(job_id, timeout=30).status is JobStatus.CANCELLED
    assert client.cancel(job_id) is False  # ended: nothing to cancel
