"""Jobs flow end to end on a real redis-server: producer → stream → worker → pub/sub."""

from __future__ import annotations

import contextlib
import random
import threading
from typing import Any

import pytest
import redis
import torch

from tokenfleet import AsyncFleetClient, FleetClient, InvalidRequest
from tokenfleet.shared.wire.keys import GROUP, Keys
from tokenfleet.shared.wire.schemas import GenerationRequest, JobStatus, SamplingParams
from tokenfleet.shared.wire.serialization import loads

from helpers import logged_tokens, stream_fault, wait_until

pytestmark = pytest.mark.timeout(180)


def greedy_reference(model: Any, tok: Any, prompt: str, n: int) -> str:
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_64_mixed_jobs_all_succeed_in_one_shared_batch(
    client: FleetClient, celery_workers: Any, r: redis.Redis, settings: Any
) -> None:
    worker = celery_workers("cpu@one", TOKENFLEET_MAX_BATCH="64", TOKENFLEET_PREFETCH="8")
    rng = random.Random(7)
    words = "the module returns a list of values when the function is called".split()
    job_ids = []
    for i in range(64):
        prompt = " ".join(rng.choices(words, k=rng.randint(1, 40)))
        job_ids.append(client.submit(prompt, max_new_tokens=rng.randint(4, 48),
                                     temperature=rng.choice([0.0, 0.7, 1.0]),
                                     top_k=rng.choice([0, 20]), seed=i))
    states = [client.wait(j, timeout=120) for j in job_ids]
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 64
    assert all(s.attempts == 1 and s.worker == "cpu@one" for s in states)
    # The worker's own figures (its heartbeat): many jobs decoded in the same step.
    key = Keys(settings.namespace).worker("cpu@one")

    def stats() -> dict[str, Any]:
        return loads(r.hget(key, "stats") or b"{}")  # type: ignore[no-any-return]

    wait_until(lambda: stats().get("jobs", {}).get("succeeded") == 64, timeout=10,
               what="the heartbeat to count 64 jobs")
    assert stats()["peak_batch"] >= 32, stats()
    assert worker.stop() == 0


@pytest.mark.slow
def test_greedy_text_equals_transformers_generate(
    client: FleetClient, start_worker: Any, loaded_tiny: tuple[Any, Any]
) -> None:
    start_worker()
    model, tok = loaded_tiny
    prompts = ["The function returns", "In Python, a list is", "This module provides",
               "An exception is raised when", "x", "Return the value of the named attribute"]
    lengths = [8, 30, 17, 40, 25, 12]
    jobs = [client.submit(p, max_new_tokens=n, temperature=0.0) for p, n in zip(prompts, lengths)]
    for job_id, prompt, n in zip(jobs, prompts, lengths):
        state = client.wait(job_id, timeout=60)
        assert state.text == greedy_reference(model, tok, prompt, n)
        assert state.finish_reason is not None and state.num_prompt_tokens == len(tok(prompt)["input_ids"])


@pytest.mark.slow
def test_stream_concatenates_to_the_final_text_even_when_subscribing_late(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    start_worker()
    early_id = client.submit("Streaming from the start", max_new_tokens=40, temperature=0.9, seed=3)
    early = list(client.stream(early_id, timeout=60))
    state = client.status(early_id)
    assert stream_fault(early, state) == ""  # contiguous events, the job's tokens and text

    late_id = client.submit("Joining after it started", max_new_tokens=60, temperature=0.0)
    keys = Keys(settings.namespace)
    started = threading.Event()

    def watch() -> None:
        # A second connection sees the first token land in the log.
        with FleetClient(settings=settings) as other:
            for _ in other.stream(late_id, timeout=60):
                started.set()
                return

    threading.Thread(target=watch, daemon=True).start()
    assert started.wait(60)
    late = list(client.stream(late_id, timeout=60))
    state = client.status(late_id)
    assert state.status is JobStatus.SUCCEEDED
    assert "".join(e.text for e in late) == state.text
    assert sum(len(e.token_ids) for e in late) == len(state.token_ids)
    assert logged_tokens(r, keys, late_id) == (state.token_ids, 0, True)


@pytest.mark.slow
def test_two_worker_processes_split_a_burst_and_no_job_runs_twice(
    client: FleetClient, celery_workers: Any, r: redis.Redis, settings: Any
) -> None:
    celery_workers("cpu@a", TOKENFLEET_MAX_BATCH="8", TOKENFLEET_PREFETCH="0")
    celery_workers("cpu@b", TOKENFLEET_MAX_BATCH="8", TOKENFLEET_PREFETCH="0")
    job_ids = [client.submit(f"Burst job {i}", max_new_tokens=24, temperature=0.0)
               for i in range(48)]
    states = [client.wait(j, timeout=120) for j in job_ids]
    assert all(s.status is JobStatus.SUCCEEDED for s in states)
    assert all(s.attempts == 1 for s in states)  # each was taken exactly once
    by_worker = {w: sum(1 for s in states if s.worker == w) for w in ("cpu@a", "cpu@b")}
    assert by_worker["cpu@a"] > 0 and by_worker["cpu@b"] > 0, by_worker
    keys = Keys(settings.namespace)
    for s in states:  # each token logged once: nothing was generated twice
        assert logged_tokens(r, keys, s.id) == (s.token_ids, 0, True)
    assert r.xlen(keys.queue("default")) == 0
    assert r.xpending(keys.queue("default"), GROUP)["pending"] == 0


def test_invalid_requests_fail_at_submit_and_nothing_reaches_redis(
    client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        client.submit("hello", max_new_tokens=0)
    with pytest.raises(InvalidRequest, match="limit of 1024"):
        client.submit("hello", max_new_tokens=100_000)
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        client.submit("")
    with pytest.raises(TypeError, match="unknown argument"):
        client.submit("hello", max_tokens=5)
    assert not list(r.scan_iter(match=f"{settings.namespace}:*"))


def test_a_malformed_entry_goes_to_the_dead_letters_and_the_worker_keeps_serving(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    start_worker()
    keys = Keys(settings.namespace)
    stream = keys.queue("default")
    r.xadd(stream, {"data": b"{not json"})
    r.xadd(stream, {"something": "else"})
    r.xadd(stream, {"data": '{"job_id": "x", "request": {"prompt": ""}, "created_at": 1}'})
    job_id = client.submit("Still serving", max_new_tokens=5)
    assert client.wait(job_id, timeout=60).status is JobStatus.SUCCEEDED
    dead = [loads(f[b"data"]) for _, f in r.xrange(keys.dlq("default"))]
    reasons = sorted(d["reason"] for d in dead)
    assert len(dead) == 3, reasons
    assert any("missing field" in x for x in reasons)
    assert any("invalid request" in x and "prompt is empty" in x for x in reasons)
    assert any("invalid request" in x or "JSON" in x for x in reasons)
    assert r.xlen(stream) == 0  # nothing left behind


def test_cancel_of_a_queued_job_takes_it_off_the_queue(
    client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    job_id = client.submit("never runs", max_new_tokens=5, require_worker=False)
    assert client.cancel(job_id) is True
    assert r.xlen(Keys(settings.namespace).queue("default")) == 0  # no longer counts as queued
    state = client.wait(job_id, timeout=10)
    assert state.status is JobStatus.CANCELLED and state.finish_reason.value == "cancelled"  # type: ignore[union-attr]
    assert list(client.stream(job_id, timeout=10)) == []
    assert client.cancel(job_id) is False


def test_a_request_object_and_metadata_round_trip(client: FleetClient, start_worker: Any) -> None:
    start_worker()
    request = GenerationRequest(prompt="Hi", sampling=SamplingParams(max_new_tokens=8),
                                metadata={"user": 7})
    state = client.wait(client.submit(request), timeout=60)
    assert state.status is JobStatus.SUCCEEDED and state.metadata == {"user": 7}
    assert 1 <= len(state.token_ids) <= 8
    assert state.created_at <= state.started_at <= state.first_token_at <= state.finished_at  # type: ignore[operator]


async def test_the_async_client_streams_and_waits(settings: Any, start_worker: Any) -> None:
    start_worker()
    async with AsyncFleetClient(settings=settings) as c:
        job_id = await c.submit("Hello", max_new_tokens=16, temperature=0.0)
        text = "".join([e.text async for e in c.stream(job_id, timeout=60)])
        state = await c.wait(job_id, timeout=60)
        assert state.status is JobStatus.SUCCEEDED and text == state.text
        assert (await c.status(job_id)).id == job_id


async def test_a_reader_that_fell_behind_gets_the_backlog_in_one_batch(
        settings: Any, start_worker: Any) -> None:
    # What the gateway relies on to write a backlog as one frame: events that
    # came in while the reader was busy elsewhere come out together, in order.
    start_worker(coalesce_ms=0)  # an event per token: a backlog of many
    async with AsyncFleetClient(settings=settings) as c:
        job_id = await c.submit("Hello", max_new_tokens=24, temperature=0.0)
        async with contextlib.aclosing(c.stream_batches(job_id, timeout=60)) as batches:
            first = await anext(batches)
            state = await c.wait(job_id, timeout=60)  # busy until the job has ended
            rest = [batch async for batch in batches]
    events = first + [e for batch in rest for e in batch]
    assert [e.index for e in events] == [0] + [e.end for e in events[:-1]]  # contiguous
    assert [t for e in events for t in e.token_ids] == state.token_ids
    assert len(events) - len(first) > 2 and len(rest) == 1


def test_a_healthy_worker_serves_a_burst_without_a_warning(
    client: FleetClient, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Errors the engine loop survives (it logs them and steps on) must not
    hide behind results that still arrive."""
    caplog.set_level("WARNING", logger="workers")
    start_worker(max_batch=8)
    jobs = [client.submit(f"job {i} says", max_new_tokens=3 + i % 9, temperature=0.0)
            for i in range(24)]
    for job_id in jobs:
        assert client.wait(job_id, timeout=60).status is JobStatus.SUCCEEDED
    assert [r.getMessage() for r in caplog.records if r.name.startswith("workers")] == []


@pytest.mark.single_redis("hears every job's channels by pattern; a cluster's are shard "
                          "channels, which no pattern matches")
def test_a_waiter_hears_the_end_alone_not_every_token(
        client: FleetClient, start_worker: Any, r: Any, settings: Any) -> None:
    """wait() (and the gateway's plain completions) follow the job's end channel:
    one message per job, where the events channel carries every token."""
    start_worker()
    keys = Keys(settings.namespace)
    heard = r.pubsub()
    heard.psubscribe(keys.ends("*"), keys.events("*"))
    assert heard.get_message(timeout=5)["type"] == "psubscribe"
    assert heard.get_message(timeout=5)["type"] == "psubscribe"
    job_id = client.submit("Count the messages", max_new_tokens=24, temperature=0.0)
    state = client.wait(job_id, timeout=60)
    assert state.status is JobStatus.SUCCEEDED
    counts = {"ends": 0, "events": 0}
    while (message := heard.get_message(timeout=0.5)) is not None:
        channel = message["channel"].decode()
        counts["ends" if channel == keys.ends(job_id) else "events"] += 1
    heard.close()
    assert counts["ends"] == 1 and counts["events"] >= 2
