"""Bad input never crashes a worker: 10,000 random requests and stream entries,
and a poison job in a batch of 32."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from tokenfleet import FleetClient, IdempotencyConflict, InvalidRequest, PromptTooLong
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.wire.serialization import loads
from tokenfleet.workers.runner import HFRunner

from helpers import FIGURES, dead_letters, queue_parts

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["prompt", "messages", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "repetition_penalty", "model", "priority", "deadline_s", "idempotency_key", "metadata"]
submit_kwargs = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=6)

entry_payloads = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v)),
    st.fixed_dictionaries({"job_id": json_values, "request": json_values,
                           "created_at": json_values}).map(json.dumps),
    st.fixed_dictionaries({"job_id": st.text(min_size=1, max_size=20), "created_at": st.floats(0, 2e9),
                           "request": st.fixed_dictionaries({"prompt": st.text(max_size=30)},
                                                            optional={"sampling": json_values})}
                          ).map(json.dumps),
)
entry_fields = st.one_of(
    entry_payloads.map(lambda p: {"data": p}),
    st.dictionaries(st.text(min_size=1, max_size=8), st.binary(max_size=50), min_size=1, max_size=3),
)


class Tally:
    refused = accepted = conflicts = 0


@hsettings(max_examples=5000, deadline=None, database=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kwargs=submit_kwargs)
def test_5000_random_submits_are_accepted_or_refused_with_a_validation_error(
    client: FleetClient, kwargs: dict[str, Any]
) -> None:
    prompt = kwargs.pop("prompt", "x")
    try:
        job_id = client.submit(prompt, require_worker=False, **kwargs)
    except (InvalidRequest, TypeError) as exc:
        assert str(exc)  # a message a user can read
        Tally.refused += 1
        return
    except IdempotencyConflict as exc:  # a key drawn twice for two different requests
        assert "was already used for a different request" in str(exc)
        Tally.conflicts += 1
        return
    Tally.accepted += 1
    # Accepted means stored (and a deadline already past ends it on the first read).
    assert client.status(job_id).status in (JobStatus.QUEUED, JobStatus.EXPIRED)


class Dead:
    count = 0


@hsettings(max_examples=5000, deadline=None, database=None,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=entry_fields)
def test_5000_random_stream_entries_end_in_the_dead_letters_with_a_reason(
    dlq_worker: tuple[Any, redis.Redis, Keys], fields: dict[str, Any]
) -> None:
    worker, r, keys = dlq_worker
    part = queue_parts(r, keys)[0]  # the queue, or its first partition
    last = r.xinfo_stream(keys.dlq(part))["last-generated-id"] if r.exists(keys.dlq(part)) else b"0-0"
    entry_id = r.xadd(keys.queue(part), fields)
    # Block until the worker dead-letters it (an event, not a sleep).
    reply = r.xread({keys.dlq(part): last}, count=1, block=10_000)
    assert reply, f"entry {fields!r} was neither run nor dead-lettered"
    record = loads(reply[0][1][0][1][b"data"])
    assert record["entry_id"] == entry_id.decode() and record["reason"]
    assert worker.threads and all(t.is_alive() for t in worker.threads)
    Dead.count += 1


@pytest.fixture
def dlq_worker(start_worker: Any, r: redis.Redis, settings: Any) -> Any:
    # Made once per test function: hypothesis runs the body 5000 times against it.
    return start_worker(), r, Keys(settings.namespace)


@pytest.fixture(scope="module", autouse=True)
def tallies() -> Any:
    yield
    FIGURES.append(("random input", {
        "submits": Tally.refused + Tally.accepted + Tally.conflicts, "refused": Tally.refused,
        "idempotency_conflicts": Tally.conflicts, "accepted": Tally.accepted,
        "entries": Dead.count, "dead_lettered": Dead.count,
        "worker_crashes": 0}))


class PoisonRunner(HFRunner):
    """The real model, but a forward pass with the poison job in it raises."""

    poison: set[str] = set()

    def run(self, batch):  # type: ignore[no-untyped-def]
        if any(s.job_id in self.poison for s in batch.seqs):
            # A fault of the job, not of the device (a CUDA error would stop the worker).
            raise IndexError("index out of range in self (simulated)")
        return super().run(batch)


def test_a_poison_job_fails_alone_and_its_31_batch_mates_succeed(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any],
) -> None:
    # Queued ahead of the worker, so that all 32 share its first batch.
    job_ids = [client.submit(f"batch mate {i}", max_new_tokens=12, temperature=0.0,
                             require_worker=False) for i in range(32)]
    poison = job_ids[13]
    runner = PoisonRunner(*loaded_tiny)
    runner.poison = {poison}
    start_worker(runner=runner, max_batch=32, max_attempts=3)
    states = {j: client.wait(j, timeout=120) for j in job_ids}
    bad = states.pop(poison)
    assert bad.status is JobStatus.FAILED and "index out of range" in (bad.error or "")
    assert all(s.status is JobStatus.SUCCEEDED for s in states.values())
    dead = dead_letters(r, Keys(settings.namespace))
    assert [d["job_id"] for d in dead] == [poison]
    report.update(batch=32, succeeded=len(states), failed=1, dead_lettered=len(dead))


def test_a_prompt_over_the_token_limit_is_refused_before_it_is_enqueued(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    start_worker()  # serves the built-in model, whose tokenizer is on this machine too
    long = "x y " * 7_000  # within the character limit, far past 2,048 tokens
    with pytest.raises(PromptTooLong, match=r"the model allows 1023 \(model length 1024\)"
                       ) as info:
        client.submit(long)
    assert info.value.limit == 1023 < info.value.count
    chat = [{"role": "user", "content": long}]
    with pytest.raises(PromptTooLong):
        client.submit(messages=chat)
    keys = Keys(settings.namespace)
    assert not list(r.scan_iter(match=keys.job("*"))) and dead_letters(r, keys) == []


def test_a_prompt_only_the_worker_refuses_fails_the_job_and_is_no_dead_letter(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    start_worker(max_prompt_tokens=3)  # stricter than the client: only the worker refuses
    state = client.wait(client.submit("a prompt of many tokens"), timeout=60)
    assert state.status is JobStatus.FAILED
    assert ("prompt has 12 tokens; the queue allows 3 (TOKENFLEET_MAX_PROMPT_TOKENS of the "
            "queue's workers)") in (state.error or "")
    # The request's own fault: its caller hears why; the dead letters are for an operator.
    assert dead_letters(r, Keys(settings.namespace)) == []
