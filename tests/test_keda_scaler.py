"""The pool's ScaledObject, queried as KEDA's redis-streams scaler queries it,
counts a declared queue's jobs at every priority level, waiting and running,
and reads zero once a worker has ended them.

KEDA v2.20.2 (pkg/scalers/redis_streams_scaler.go) picks its query from the
trigger's metadata: with no ``consumerGroup`` it reads ``XLEN <stream>`` (0
for a stream that does not exist); with a group and ``lagCount`` it reads the
group's ``lag`` from ``XINFO GROUPS`` (0 with no stream, ``XLEN`` with no
group, and -1 where Redis answers nil: go-redis v9.22 reads a nil lag so);
with a group alone, the ``XPENDING`` count. The ScaledObject's formula adds
the levels' values. The manifests use the first: why is in docs/deploy.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from tests.kustomize import Obj, of_kind, render
from tokenfleet.shared.wire.keys import GROUP, PRIORITIES, Keys
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.settings import get_settings
from tokenfleet.workers.runner import HFRunner

pytestmark = pytest.mark.timeout(120)
QUEUE = "default"  # the queue of the rendered base


def keda_reads(r: redis.Redis, meta: Obj) -> int:
    """What one redis-streams trigger reads, the way KEDA 2.20.2 reads it."""
    stream, group = meta["stream"], meta.get("consumerGroup")
    if not group:
        return int(r.xlen(stream))
    if "lagCount" not in meta:
        return int(r.xpending(stream, group)["pending"])
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError as e:
        if "no such key" in str(e):
            return 0
        raise
    for info in groups:
        name = info["name"]
        if (name.decode() if isinstance(name, bytes) else name) == group:
            return -1 if info["lag"] is None else int(info["lag"])
    return int(r.xlen(stream))


class SlowRunner(HFRunner):
    """The real model at a big model's pace, so that a long job is still
    running when the test reads the metric."""

    def run(self, batch):  # type: ignore[no-untyped-def]
        time.sleep(0.02)  # simulated compute time, not synchronisation
        return super().run(batch)


@pytest.fixture(scope="module")
def triggers() -> dict[str, Obj]:
    [scaled] = of_kind(render("cpu"), "ScaledObject")
    return {t["name"]: t["metadata"] for t in scaled["spec"]["triggers"]}


@pytest.fixture
def formula(triggers: dict[str, Obj], settings: Any,
            r: redis.Redis) -> Callable[[], dict[str, int]]:
    """Each level's value as the ScaledObject reads it. The rendered streams
    are the default namespace's; this test's keys carry a namespace of their own."""
    def read() -> dict[str, int]:
        return {level: keda_reads(r, {**meta, "stream": meta["stream"].replace(
            "tokenfleet:", f"{settings.namespace}:", 1)}) for level, meta in triggers.items()}
    return read


def declare(settings: Any, queue: str) -> None:
    """``tokenfleet queue create QUEUE``, as an operator runs it for a pool at zero."""
    from tokenfleet.cli.app import main

    result = CliRunner().invoke(main, ["queue", "create", queue], env={
        "TOKENFLEET_REDIS_URL": settings.redis_url, "TOKENFLEET_NAMESPACE": settings.namespace})
    get_settings.cache_clear()  # read under the runner's environment: not this process's
    assert result.exit_code == 0, result.output


def test_the_scaler_counts_waiting_and_running_jobs_and_zero_after_a_worker(
        formula: Callable[[], dict[str, int]], settings: Any, client: Any, r: redis.Redis,
        start_worker: Callable[..., Any], loaded_tiny: Any) -> None:
    declare(settings, QUEUE)
    assert formula() == dict.fromkeys(PRIORITIES, 0)  # no stream yet: nothing to wake for
    short = [client.submit("Hello", model=QUEUE, priority=level, max_new_tokens=2)
             for level, n in zip(PRIORITIES, (25, 25, 25, 25), strict=True) for _ in range(n)]
    long = client.submit("A long story", model=QUEUE, priority="high", max_new_tokens=1000)
    # A declared queue took 100 jobs with no worker; the pool at zero wakes: 101 > 0.
    assert formula() == {"high": 26, "normal": 25, "low": 25, "batch": 25}
    start_worker(queue=QUEUE, runner=SlowRunner(*loaded_tiny))
    for job_id in short:
        assert client.wait(job_id, timeout=60).status is JobStatus.SUCCEEDED
    # Nothing waits, one job runs: the pool must keep a worker for it.
    assert client.status(long).status is JobStatus.RUNNING
    assert formula() == {"high": 1, "normal": 0, "low": 0, "batch": 0}
    # The group's lag would read nothing to do (0, or -1 where Redis has no
    # lag), and KEDA would scale the pool away under the running job.
    lag = {"consumerGroup": GROUP, "lagCount": "32"}
    keys = Keys(settings.namespace)
    assert keda_reads(r, {**lag, "stream": keys.queue(f"{QUEUE}:high")}) <= 0
    assert client.cancel(long) is True
    assert client.wait(long, timeout=30).status is JobStatus.CANCELLED
    assert formula() == dict.fromkeys(PRIORITIES, 0)  # the pool may go back to zero


def test_a_cancelled_waiting_job_leaves_the_group_with_no_lag_but_the_length_right(
        formula: Callable[[], dict[str, int]], settings: Any, client: Any,
        r: redis.Redis) -> None:
    """Cancel deletes a queued job's entry; once a worker has created the group
    (a pool that ran before and is at zero now), Redis has no lag for it."""
    declare(settings, QUEUE)
    stream = Keys(settings.namespace).queue(QUEUE)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)  # as a worker's feeder does
    jobs = [client.submit("Hello", model=QUEUE, max_new_tokens=2) for _ in range(3)]
    # Not the first: a deleted head entry leaves the lag known; one behind it does not.
    assert client.cancel(jobs[1]) is True
    # KEDA's lag query reads -1: below the activation threshold, the pool stays at zero.
    assert keda_reads(r, {"stream": stream, "consumerGroup": GROUP, "lagCount": "32"}) == -1
    assert formula()["normal"] == 2  # the stream length counts the jobs that wait
    assert [client.status(j).status for j in jobs] == [
        JobStatus.QUEUED, JobStatus.CANCELLED, JobStatus.QUEUED]
