"""A device that fails for good: a CUDA error ("illegal memory access") poisons the
CUDA context, so every later forward pass fails too. The worker must not burn its
jobs' attempts on it: it stops taking jobs, hands back what it holds, leaves the
fleet and exits non-zero; another worker completes the jobs."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import GROUP, Keys
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.workers.engine import is_fatal_device_error
from tokenfleet.workers.publisher import is_transient
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import StepBatch
from tokenfleet.workers import supervisor
from tokenfleet.workers.exit_codes import FATAL as FATAL_EXIT_CODE
from tokenfleet.workers.exit_codes import JOB_FAULT as JOB_FAULT_EXIT_CODE
from tokenfleet.workers.supervisor import Child, Supervisor

from helpers import dead_letters, direct_greedy, logged_tokens, queue_parts


@pytest.fixture
def settings(settings: Any) -> Any:
    """These tests queue their jobs before the worker that runs them starts."""
    return settings.model_copy(update={"require_worker": False})


pytestmark = [pytest.mark.faults, pytest.mark.timeout(240)]

CUDA_ERROR = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might "
              "be asynchronously reported at some other API call")


class BreakingRunner(HFRunner):
    """The real model until its device breaks: after ``good_steps`` forward passes
    every one raises ``error``, as on a GPU whose CUDA context is poisoned."""

    def __init__(self, loaded: tuple[Any, Any], good_steps: int, error: Exception) -> None:
        super().__init__(*loaded)
        self.good_steps, self.error, self.steps = good_steps, error, 0

    def run(self, batch: StepBatch) -> list[int]:
        self.steps += 1
        if self.steps > self.good_steps:
            raise self.error
        return super().run(batch)


def prompts(n: int) -> list[str]:
    return [f"the device {i} fails" for i in range(n)]


def submit(client: FleetClient, n: int, tokens: int) -> list[str]:
    return [client.submit(p, max_new_tokens=tokens, temperature=0.0) for p in prompts(n)]


def greedy_texts(loaded: tuple[Any, Any], n: int, tokens: int) -> list[str]:
    """What the texts must be: the same engine in-process, no Redis, no faults."""
    return direct_greedy(loaded, [(p, tokens) for p in prompts(n)])


def check_handed_back(r: redis.Redis, keys: Keys, job_ids: list[str], worker: str) -> int:
    """Nothing failed or dead-lettered, nothing left pending with the worker;
    returns how many jobs went back to the queue."""
    statuses = [r.hget(keys.job(j), "status") for j in job_ids]
    assert b"failed" not in statuses and dead_letters(r, keys) == [], statuses
    for part in queue_parts(r, keys):
        consumers = {c["name"]: c["pending"] for c in r.xinfo_consumers(keys.queue(part), GROUP)}
        assert consumers.get(worker.encode(), 0) == 0, consumers
        assert r.zscore(keys.queue_workers(part), worker) is None
    # It left the fleet: no heartbeat says it is healthy.
    assert not r.exists(keys.worker(worker))
    return statuses.count(b"queued")


def check_completed(client: FleetClient, r: redis.Redis, keys: Keys, job_ids: list[str],
                    reference: list[str]) -> list[Any]:
    """Every job succeeded, its log whole and equal to its result, its text the
    undisturbed run's."""
    states = [client.wait(j, timeout=120) for j in job_ids]
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * len(job_ids)
    for state in states:
        logged, _, _ = logged_tokens(r, keys, state.id)
        assert logged == state.token_ids, f"job {state.id}: its log is not its result"
    assert [s.text for s in states] == reference
    return states


def test_a_cuda_error_stops_the_worker_and_another_completes_its_jobs(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    job_ids = submit(client, 6, 40)
    runner = BreakingRunner(loaded_tiny, good_steps=10, error=RuntimeError(CUDA_ERROR))
    broken = start_worker("broken@test", runner=runner)
    assert broken.fatal.wait(60), "the worker did not give up on its device"

    assert "illegal memory access" in broken.fatal_reason
    # The first failed step was the last: no retry on a poisoned context, no job
    # charged with the device's failure by the poison rule.
    assert runner.steps == 11 and broken.engine.stats.failed_steps == 1
    assert not any(t.is_alive() for t in broken.threads), "it still takes or runs jobs"
    handed_back = check_handed_back(r, keys, job_ids, broken.name)
    assert handed_back == 6

    start_worker("healthy@test")
    states = check_completed(client, r, keys, job_ids, greedy_texts(loaded_tiny, 6, 40))
    # Resumed from their logs: the tokens made before the failure were kept.
    assert all(s.attempts == 2 for s in states)
    report.update(jobs=6, handed_back=handed_back, completed=len(states), failed=0,
                  dead_lettered=0, failed_steps_on_broken_worker=1)


def test_steps_failing_in_a_row_make_the_worker_give_up(
    client: FleetClient, start_worker: Any, loaded_tiny: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    job_ids = submit(client, 4, 30)
    # Not a recognised device error: only the run of failures tells the device is gone.
    runner = BreakingRunner(loaded_tiny, good_steps=5, error=RuntimeError("mysterious failure"))
    broken = start_worker("broken@test", runner=runner, max_failed_steps=3, max_attempts=3)
    assert broken.fatal.wait(60), "the worker did not give up"

    assert "3 steps failed in a row" in broken.fatal_reason
    assert runner.steps == 5 + 3
    handed_back = check_handed_back(r, keys, job_ids, broken.name)
    assert handed_back == 4

    start_worker("healthy@test")
    states = check_completed(client, r, keys, job_ids, greedy_texts(loaded_tiny, 4, 30))
    report.update(jobs=4, failed_steps=3, handed_back=handed_back, completed=len(states),
                  failed=0, dead_lettered=0)


def test_a_celery_worker_whose_device_fails_exits_non_zero_and_loses_no_job(
    client: FleetClient, celery_workers: Any, r: redis.Redis, settings: Any, tmp_path: Path,
    report: dict[str, Any],
) -> None:
    # A test hook, in this test's own directory: the child's runner (either KV
    # cache's) breaks after ten forward passes (``sitecustomize`` is imported at
    # interpreter start).
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f'''
        from tokenfleet.workers import paged_runner, runner

        _steps = [0]

        def breaking(_run):
            def run(self, batch):
                _steps[0] += 1
                if _steps[0] > 10:
                    raise RuntimeError({CUDA_ERROR!r})
                return _run(self, batch)
            return run

        runner.HFRunner.run = breaking(runner.HFRunner.run)
        paged_runner.PagedRunner.run = breaking(paged_runner.PagedRunner.run)
    '''))
    keys = Keys(settings.namespace)
    broken = celery_workers("cpu@broken", PYTHONPATH=str(tmp_path))
    job_ids = submit(client, 6, 40)
    code = broken.proc.wait(timeout=90)
    assert code == FATAL_EXIT_CODE, broken.output()[-3000:]
    assert "illegal memory access" in broken.output()
    handed_back = check_handed_back(r, keys, job_ids, broken.node)

    celery_workers("cpu@healthy")
    states = [client.wait(j, timeout=120) for j in job_ids]
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 6
    assert all(s.worker == "cpu@healthy" for s in states)
    report.update(jobs=6, exit_code=code, handed_back=handed_back, completed=len(states),
                  failed=0, dead_lettered=0)


@pytest.mark.parametrize("error,fatal", [
    (RuntimeError(CUDA_ERROR), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( ... )`"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("CUDA error: out of memory"), False),
    (RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), False),
    (IndexError("index out of range in self"), False),
])
def test_only_errors_that_poison_the_device_are_fatal(error: Exception, fatal: bool) -> None:
    assert is_fatal_device_error(error) is fatal


@pytest.mark.parametrize("error,transient", [
    (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), True),
    (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), True),
    (redis.exceptions.ResponseError("MISCONF Redis is configured to save RDB snapshots"), True),
    (redis.exceptions.NoScriptError("No matching script."), True),
    (redis.exceptions.ConnectionError("Connection closed by server."), True),
    (redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"), False),
])
def test_a_refused_write_is_retried_only_when_redis_itself_is_the_cause(
    error: Exception, transient: bool
) -> None:
    assert is_transient(error) is transient


class ExitedProcess:
    """A child process that has already exited with ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code

    def poll(self) -> int:
        return self.code


class FakeTime:
    """The supervisor's clock: a sleep moves it on at once."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("crash,starts,gives_up", [
    (JOB_FAULT_EXIT_CODE, 9, False),  # eight job-fault crashes, then a clean exit
    (FATAL_EXIT_CODE, 5, True),  # a broken device: given up at max_restarts
])
def test_crashes_a_job_caused_do_not_make_the_supervisor_give_up_on_the_worker(
    monkeypatch: pytest.MonkeyPatch, crash: int, starts: int, gives_up: bool
) -> None:
    exits = iter([crash] * 8 + [0])
    started: list[list[str]] = []

    def popen(cmd: list[str], env: dict[str, str]) -> ExitedProcess:
        started.append(cmd)
        return ExitedProcess(next(exits))

    monkeypatch.setattr(supervisor, "time", FakeTime())
    monkeypatch.setattr(supervisor.signal, "signal", lambda *_: None)
    lines: list[str] = []
    run = Supervisor([Child("w-gpu0@host", ["celery"], {})], max_restarts=5, say=lines.append,
                     popen=popen)
    code = run.run()

    assert len(started) == starts
    assert code == (crash if gives_up else 0)
    assert any("giving up" in line for line in lines) is gives_up, lines
