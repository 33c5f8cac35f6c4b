"""The batch level on a real worker and a real redis-server: live jobs that
come while batch jobs fill every slot start about as soon as on an idle
worker (the batch jobs are handed back for them), and a batch job handed back
resumes from its token log to the very text an undisturbed run makes, with
no token logged twice."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient, JobStatus
from tokenfleet.client.protocol import build_request, submission
from tokenfleet.shared.wire.client_scripts import SubmitVerdict
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.bench.gpu_sim import build_gpu_sim
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.service import Worker

from helpers import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# A step time that hardly depends on the batch, as a GPU's: 32 live jobs fit
# in the batch beside nothing else.
SIM = {"engine": "gpu-sim", "gpu_sim_step_ms": 5, "max_batch": 32, "prefetch": 2}
LIVE = 32
ROUNDS = 8


def burst(client: FleetClient, n: int, priority: str, max_new_tokens: int) -> list[str]:
    """``n`` submits in one pipeline: they reach the queue together."""
    now = client.clock.read(client.redis)
    subs = [submission(build_request(f"request {i}", {"max_new_tokens": max_new_tokens,
                                                      "priority": priority}, client.settings),
                       client.keys, client.settings, True, now)
            for i in range(n)]
    pipe = client.redis.pipeline(transaction=False)
    for sub in subs:
        pipe.execute_command(*sub.call.command())
    for sub, reply in zip(subs, pipe.execute()):
        assert sub.call.decode(reply).admission is SubmitVerdict.QUEUED
    return [sub.job_id for sub in subs]


def ttfts(client: FleetClient, job_ids: list[str]) -> list[float]:
    states = [client.wait(job_id, timeout=30) for job_id in job_ids]
    assert all(s.status is JobStatus.SUCCEEDED for s in states), states
    return [s.first_token_at - s.created_at for s in states
            if s.first_token_at and s.created_at]


@pytest.fixture
def start_sim(worker_env: Callable[..., Any]) -> Iterator[Callable[..., Worker]]:
    """An in-process worker on the gpu-sim engine (``SIM``, then ``overrides``),
    its settings read from the environment as a Celery worker's are."""
    started: list[Worker] = []

    def start(**overrides: Any) -> Worker:
        built = build_gpu_sim(worker_env(**{**SIM, **overrides}))
        worker = Worker(built.settings, built.engine, built.tokenizer, name="sim@test")
        worker.start()
        started.append(worker)
        served = worker.keys.queue_workers(worker.queue)
        wait_until(lambda: worker.redis.zscore(served, worker.name) is not None, timeout=30,
                   what="the worker's first heartbeat")
        return worker

    yield start
    for worker in started:
        worker.stop(grace_s=0)


@pytest.mark.parametrize("fair_share", [True, False])
def test_batch_jobs_fill_the_free_slots_and_none_waits_in_the_worker(
        settings: Any, start_sim: Callable[..., Worker], fair_share: bool) -> None:
    worker = start_sim(max_batch=8, prefetch=4, fair_share=fair_share)
    with FleetClient(settings=settings) as client:
        live = [client.submit(f"live {i}", max_new_tokens=1024) for i in range(3)]
        batch = [client.submit(f"batch {i}", priority="batch", max_new_tokens=1024)
                 for i in range(20)]
        wait_until(lambda: worker.engine.num_running == 8, timeout=10,
                   what="batch jobs to fill the free slots")
        # Prefetch is for live jobs: the worker holds no batch job beyond its
        # slots, step after step (the feeder reads all along).
        held: list[int] = []
        steps = worker.engine.stats.steps
        wait_until(lambda: held.append(worker.engine.num_held) or
                   worker.engine.stats.steps >= steps + 20, timeout=10, what="20 more steps")
        statuses = [client.status(j).status for j in batch]
        for job_id in live + batch:
            client.cancel(job_id)
    assert max(held) == 8, held
    assert statuses.count(JobStatus.RUNNING) == 5 and statuses.count(JobStatus.QUEUED) == 15


def test_live_jobs_start_as_soon_beside_a_full_batch_as_on_an_idle_worker(
        settings: Any, start_sim: Callable[..., Worker], r: redis.Redis) -> None:
    """Rounds of two bursts of 32 live jobs: one on the idle worker, one while
    batch jobs fill its batch (a burst is one sample of where the worker is in
    its step when it comes; the rounds alternate, so a load on the machine
    falls on both alike)."""
    keys = Keys(settings.namespace)
    worker = start_sim()
    idle: list[float] = []
    busy: list[float] = []
    handbacks = 0
    with FleetClient(settings=settings) as client:
        # A first job loads the scripts the pipelined bursts call by hash.
        assert client.wait(client.submit("warm up", max_new_tokens=1), timeout=10).text
        for _ in range(ROUNDS):
            idle += ttfts(client, burst(client, LIVE, "normal", max_new_tokens=8))
            # Batch jobs fill every slot, and more wait in their stream.
            batch = burst(client, 48, "batch", max_new_tokens=1024)
            wait_until(lambda: worker.engine.num_running == SIM["max_batch"]
                       and worker.engine.num_held == SIM["max_batch"], timeout=10,
                       what="batch jobs to fill the batch")
            busy += ttfts(client, burst(client, LIVE, "normal", max_new_tokens=8))
            # A live job's first token does not wait for its victim's hand-back
            # (the engine thread writes it after the step), so the count is
            # awaited, not read at once.
            def handed_back(batch: list[str] = batch) -> int:
                return sum(int(r.hget(keys.job(j), "handbacks") or 0) for j in batch)
            wait_until(lambda: handed_back() >= LIVE, timeout=10,
                       what="a batch job handed back for each live one")
            handbacks += handed_back()
            for job_id in batch:  # idle again for the next round
                client.cancel(job_id)
            wait_until(lambda: not worker.busy, timeout=10, what="the batch's cancels")
    idle_p50, busy_p50 = statistics.median(idle), statistics.median(busy)
    print(f"live TTFT p50: idle {idle_p50 * 1000:.1f} ms, beside a full batch "
          f"{busy_p50 * 1000:.1f} ms; {handbacks} batch job hand-backs")
    assert handbacks >= ROUNDS * LIVE, "batch jobs were not handed back for live ones"
    assert worker.engine.stats.preempted >= ROUNDS * LIVE
    # The TTFT ratio is a benchmark figure (printed above, with its ratio
    # below), not a pass/fail line: on a shared machine it measures the load.
    print(f"live TTFT p50 ratio beside a full batch / idle: {busy_p50 / idle_p50:.2f}")


class SlowRunner(HFRunner):
    """The real tiny model at a larger model's pace, so batch jobs are still
    running when the live jobs come."""

    def run(self, batch):  # type: ignore[no-untyped-def]
        time.sleep(0.01)  # simulated compute time, not synchronisation
        return super().run(batch)


PROMPTS = ["Once upon a time", "The river ran", "In the beginning", "A cold day in April"]


def log_tokens(r: redis.Redis, keys: Keys, job_id: str) -> list[int]:
    """Every token of a job's log, in its entries' order (a token logged twice
    shows twice)."""
    tokens: list[int] = []
    for _id, fields in r.xrange(keys.out(job_id)):
        event = json.loads(fields[b"e"])
        if event.get("k") == "tok":
            assert event["index"] == len(tokens), "an event does not start where the last ended"
            tokens.extend(event["token_ids"])
    return tokens


def test_a_preempted_batch_job_resumes_to_the_text_of_an_undisturbed_run(
        settings: Any, client: FleetClient, r: redis.Redis, loaded_tiny: Any,
        start_worker: Callable[..., Worker]) -> None:
    keys = Keys(settings.namespace)
    worker = start_worker(runner=SlowRunner(*loaded_tiny), max_batch=len(PROMPTS), prefetch=1)

    def run_batch() -> list[str]:
        return [client.submit(p, priority="batch", max_new_tokens=48, temperature=0.0)
                for p in PROMPTS]

    undisturbed = [client.wait(j, timeout=30) for j in run_batch()]
    assert all(s.status is JobStatus.SUCCEEDED for s in undisturbed)
    assert all(int(r.hget(keys.job(s.id), "handbacks") or 0) == 0 for s in undisturbed)

    jobs = run_batch()
    wait_until(lambda: all(r.xlen(keys.out(j)) >= 4 for j in jobs), timeout=20,
               what="every batch job to have tokens logged")
    live = [client.submit(f"live {i}", max_new_tokens=8) for i in range(len(PROMPTS))]
    assert all(client.wait(j, timeout=30).status is JobStatus.SUCCEEDED for j in live)
    resumed = [client.wait(j, timeout=30) for j in jobs]

    assert worker.engine.stats.preempted >= 1
    handbacks = [int(r.hget(keys.job(s.id), "handbacks") or 0) for s in resumed]
    assert all(n >= 1 for n in handbacks), handbacks  # 4 live jobs took all 4 slots
    for before, after in zip(undisturbed, resumed):
        assert after.status is JobStatus.SUCCEEDED
        assert after.text == before.text and after.token_ids == before.token_ids
        assert log_tokens(r, keys, after.id) == after.token_ids  # no token twice, none lost
