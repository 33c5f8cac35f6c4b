"""Jobs an engine refuses or cannot run, on the built-in engine: each ends
``failed`` at once with the reason, frees its slot, and the worker serves on.

- a request the engine refuses before it takes it (``Engine.refusal``);
- a request the engine raises on as it takes it (``_add``: vLLM's
  ``add_request`` does for what its own validation rejects);
- a resumed job whose token log holds ids outside the model's vocabulary,
  which would make the forward pass index past the embedding.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import GROUP, Keys, level_queue
from tokenfleet.shared.wire.schemas import REFUSED_BY_WORKER, FinishReason, JobStatus
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.sequence import Sequence

from helpers import dead_letters, queue_parts


@pytest.fixture
def settings(settings: Any) -> Any:
    """These tests queue their jobs before the worker that runs them starts."""
    return settings.model_copy(update={"require_worker": False})


pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

REFUSED_SEED = 13  # the seed the test engines below refuse


def log_as_resumed(r: redis.Redis, keys: Keys, job_id: str, token_ids: list[Any]) -> None:
    """Make a queued job look handed back after an earlier attempt that logged
    ``token_ids``: the worker that takes it resumes from them."""
    r.hset(keys.job(job_id), "attempts", 1)
    event = {"index": 0, "token_ids": token_ids, "text": "x" * len(token_ids)}
    r.xadd(keys.out(job_id), {"e": json.dumps(event)}, id=f"0-{len(token_ids)}")


def check_served_on(client: FleetClient, worker: Any, good: list[str]) -> None:
    """The good jobs succeeded, no step failed, and the worker still serves."""
    assert [client.wait(j, timeout=60).status for j in good] == [JobStatus.SUCCEEDED] * len(good)
    assert worker.engine.stats.failed_steps == 0 and worker.engine_loop.failing == ""
    assert not worker.fatal.is_set() and all(t.is_alive() for t in worker.threads)
    after = client.submit("served after the refusals", max_new_tokens=4)
    assert client.wait(after, timeout=30).status is JobStatus.SUCCEEDED


def test_a_request_the_engine_raises_on_as_it_takes_it_fails_alone_and_frees_its_slot(
    client: FleetClient, start_worker: Any, monkeypatch: pytest.MonkeyPatch,
    report: dict[str, Any],
) -> None:
    take = HFEngine._add

    def refusing_add(self: HFEngine, seq: Sequence) -> None:
        if seq.sampling.seed == REFUSED_SEED:
            raise ValueError(f"seed must not be {REFUSED_SEED}, got {REFUSED_SEED}")
        take(self, seq)

    monkeypatch.setattr(HFEngine, "_add", refusing_add)
    # Two slots and three refused jobs: a refused job that kept its slot would
    # leave the good ones none.
    refused = [client.submit(f"refused {i}", max_new_tokens=8, seed=REFUSED_SEED)
               for i in range(3)]
    good = [client.submit(f"good job {i}", max_new_tokens=8, temperature=0.0)
            for i in range(6)]
    worker = start_worker(max_batch=2, prefetch=1)

    for job_id in refused:
        state = client.wait(job_id, timeout=30)
        assert state.status is JobStatus.FAILED and state.finish_reason is FinishReason.ERROR
        assert state.error == (f"the engine refused the request: seed must not be "
                               f"{REFUSED_SEED}, got {REFUSED_SEED}")
    check_served_on(client, worker, good)
    assert worker.engine.num_held == 0
    report.update(refused=3, failed=3, good=6, succeeded=6, failed_steps=0)


def test_a_request_the_engine_says_it_refuses_fails_before_it_takes_a_slot(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = Keys(settings.namespace)
    taken: list[str] = []
    take = HFEngine._add

    def refusal(self: HFEngine, seq: Sequence) -> str | None:
        if seq.sampling.seed == REFUSED_SEED:
            return f"seed must not be {REFUSED_SEED}"
        return None

    def add(self: HFEngine, seq: Sequence) -> None:
        taken.append(seq.job_id)
        take(self, seq)

    monkeypatch.setattr(HFEngine, "refusal", refusal)
    monkeypatch.setattr(HFEngine, "_add", add)
    refused = client.submit("refused", max_new_tokens=8, seed=REFUSED_SEED, priority="high")
    good = [client.submit(f"good job {i}", max_new_tokens=8, priority="high") for i in range(4)]
    worker = start_worker(max_batch=2, prefetch=1)

    state = client.wait(refused, timeout=30)
    assert state.status is JobStatus.FAILED
    assert state.error == f"{REFUSED_BY_WORKER}seed must not be {REFUSED_SEED}"
    check_served_on(client, worker, good)
    assert refused not in taken, "the engine was handed a request it refuses"
    for part in queue_parts(r, keys):
        assert r.xpending(keys.queue(level_queue(part, "high")), GROUP)["pending"] == 0


def test_a_token_log_with_ids_outside_the_vocabulary_fails_its_job_alone_before_any_step(
    client: FleetClient, start_worker: Any, r: redis.Redis, settings: Any, loaded_tiny: Any,
    report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    vocab = loaded_tiny[0].get_input_embeddings().num_embeddings
    hostile = {
        client.submit("past the end", max_new_tokens=8): [5, vocab],
        client.submit("far past it", max_new_tokens=8): [5, 6, 10**6],
        client.submit("far past any", max_new_tokens=8): [2**40],
    }
    for job_id, token_ids in hostile.items():
        log_as_resumed(r, keys, job_id, token_ids)
    good = [client.submit(f"good job {i}", max_new_tokens=8) for i in range(6)]
    resumed = client.submit("a sound log", max_new_tokens=8, temperature=0.0)
    log_as_resumed(r, keys, resumed, [5, vocab - 1])
    worker = start_worker(max_batch=4, prefetch=2)

    bad_ids = {job_id: ids[-1] for job_id, ids in hostile.items()}
    for job_id, bad in bad_ids.items():
        state = client.wait(job_id, timeout=30)
        assert state.status is JobStatus.FAILED
        assert state.error == (f"token log holds id {bad!r} outside the vocabulary of "
                               f"{vocab} (ids 0 to {vocab - 1})")
    dead = {d["job_id"] for d in dead_letters(r, keys)}
    assert dead == set(hostile)
    check_served_on(client, worker, good)
    # The highest id in the vocabulary is sound: that job resumes after its tokens.
    state = client.wait(resumed, timeout=30)
    assert state.status is JobStatus.SUCCEEDED and state.token_ids[:2] == [5, vocab - 1]
    report.update(hostile_logs=3, failed=3, good=6, succeeded=6, failed_steps=0)
