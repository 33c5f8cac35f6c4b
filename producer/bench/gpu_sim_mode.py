"""``--modes gpu-sim``: the fleet in front of a GPU-shaped engine.

One Celery worker runs the ``gpu-sim`` engine (``tokenfleet.bench.gpu_sim``:
each step waits ``--step-ms`` with the GIL released, then makes one token per
running sequence) at ``--max-batch`` B. N jobs (``--jobs``, default B) of
exactly ``--max-new-tokens`` each go in at once through ``AsyncFleetClient``,
which then waits for each job's end (one end message per job, so the client
takes no CPU from the worker while tokens flow). A GPU behind the fleet could
make ``B x 1000 / S`` tokens per second; what the fleet makes of it is told two
ways:

- steady: the steps that ran the full batch, timed by the engine itself
  (``GpuSimStats`` in the worker's heartbeat, ``stats.gpu_sim``): B tokens per
  step over the steps' cycles, each from one step's start to the next one's;
  where the engine thread's time went in those cycles: in the device step, in
  ``Engine.advance`` around it (requests, ends by token id), and between steps
  (the hand-over to the output thread, which waits while that thread is
  behind: detokenization, stop strings, the step's Redis writes, metrics);
- whole run: every token over the client's time from the first submit to the
  last end, the ramp and the client's own round trips included.

And the machine's own part: how late a bare sleep of the step's length ends
here, on a thread of the bench with the engine thread's timer slack, while
nothing else of the fleet runs in that process (``sleep_late``, a share of a
step): the part of the device step's lateness no change to the fleet removes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import redis

from tokenfleet import AsyncFleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus
from tokenfleet.shared.wire.serialization import loads
from tokenfleet.shared.settings import get_settings
from tokenfleet.bench.modes import BenchEnv
from tokenfleet.bench.procs import BenchError, CeleryProc, wait_for
from tokenfleet.bench.workload import make_jobs
from tokenfleet.bench.gpu_sim import precise_sleeps

Tick = Callable[[int], None]
Phase = Callable[[str, int], AbstractContextManager[Tick]]
TIMES = ("steps", "tokens", "device_s", "step_s", "between_s", "idle_s")  # gpu_sim.StepTimes
ASYNC = "async"  # beside the batch sizes in a settled reading: whether the engine ran ahead
BARE_SLEEPS = 50  # sleeps of a step's length timed alone, for the machine's part


def run(env: BenchEnv, batch: int, jobs: int, max_new_tokens: int, step_ms: float,
        phase: Phase) -> dict[str, Any]:
    """One worker of the gpu-sim engine at ``batch``, ``jobs`` jobs through it;
    its figures (``figures``)."""
    prompts = [job.prompt for job in make_jobs(jobs, max_new_tokens)]
    with SimWorker(env, batch, step_ms, phase) as sim:
        # The first steps of a worker are slow (imports, first allocations).
        warm = prompts[:min(batch, jobs)]
        _through(env.redis_url, sim.namespace, warm, 2, sim.worker)
        before = sim.settled(len(warm))
        with phase(f"gpu-sim  c={batch}", jobs) as tick:
            elapsed, tokens = _through(env.redis_url, sim.namespace, prompts, max_new_tokens,
                                       sim.worker, tick)
        after = sim.settled(len(warm) + jobs)
    return figures(before, after, min(batch, jobs), step_ms, jobs, max_new_tokens, tokens,
                   elapsed, sleep_late(step_ms / 1000))


class SimWorker:
    """One Celery worker of the gpu-sim engine at ``batch``, on the bench's Redis."""

    def __init__(self, env: BenchEnv, batch: int, step_ms: float, phase: Phase,
                 label: str = "gpu-sim") -> None:
        label = f"{label}-c{batch}"
        self.namespace, self.node = env.namespace(label), f"{label}@bench"
        self.keys = Keys(self.namespace)
        self.redis = redis.Redis.from_url(env.redis_url)
        worker_env = {**env.worker_env(self.namespace, env.model, batch),
                      "TOKENFLEET_ENGINE": "gpu-sim", "TOKENFLEET_GPU_SIM_STEP_MS": str(step_ms)}
        with phase(f"{label}: starting", 1):
            self.worker = CeleryProc("tokenfleet.workers.app", self.node, worker_env)
        try:
            heartbeat = self.keys.worker(self.node)
            wait_for(lambda: self.redis.exists(heartbeat) or not self.worker.alive(), 300,
                     f"worker {self.node} to start")
            self.worker.check()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SimWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.worker.close()
        self.redis.close()

    def settled(self, jobs: int) -> dict[str, Any]:
        """The engine's step times once its heartbeat counts ``jobs`` ended jobs."""
        return _settled(self.redis, self.keys.worker(self.node), jobs)


def sleep_late(step_s: float, n: int = BARE_SLEEPS) -> float:
    """How late, on average, a sleep of ``step_s`` ends on this machine, timed
    on a thread of its own with the engine thread's timer slack (seconds)."""
    late: list[float] = []

    def sleeps() -> None:
        precise_sleeps()
        for _ in range(n):
            started = time.perf_counter()
            time.sleep(step_s)
            late.append(time.perf_counter() - started - step_s)

    thread = threading.Thread(target=sleeps, name="bare-sleeps")
    thread.start()
    thread.join()
    return sum(late) / len(late)


def _settled(client: redis.Redis, heartbeat: str, jobs: int) -> dict[str, Any]:
    """The engine's step times once the heartbeat counts ``jobs`` ended jobs."""
    def read() -> dict[str, Any] | None:
        raw = client.hget(heartbeat, "stats")
        stats: dict[str, Any] = loads(raw) if raw else {}
        if sum(stats.get("jobs", {}).values()) < jobs:
            return None
        # Truthy even when no step was counted.
        return {"gpu_sim": stats["gpu_sim"], "async": stats.get("gpu_sim_async", False)}

    settled: dict[str, Any] = wait_for(read, 30,
                                       f"the heartbeat of {heartbeat} to count {jobs} jobs")
    return {**settled["gpu_sim"], ASYNC: settled["async"]}


def _through(url: str, namespace: str, prompts: list[str], max_new_tokens: int,
             worker: CeleryProc, tick: Tick = lambda n: None) -> tuple[float, int]:
    """Submit every prompt at once, wait for every end: (seconds, tokens)."""
    async def go() -> tuple[float, int]:
        settings = get_settings().model_copy(update={"require_worker": False})
        async with AsyncFleetClient(url, namespace=namespace, settings=settings) as fleet:
            async def one(job_id: str) -> int:
                state = await fleet.wait(job_id, timeout=3600)
                tick(1)
                if state.status is not JobStatus.SUCCEEDED or (
                        state.finish_reason is not FinishReason.LENGTH):
                    raise BenchError(f"gpu-sim job {job_id} ended {state.status.value} "
                                     f"({state.finish_reason}, {state.error}), not at its "
                                     f"length:\n{worker.output()}")
                return len(state.token_ids)

            started = time.perf_counter()
            ids = await asyncio.gather(*(fleet.submit(p, max_new_tokens=max_new_tokens,
                                                      temperature=0.0) for p in prompts))
            made = await asyncio.gather(*(one(job_id) for job_id in ids))
            return time.perf_counter() - started, sum(made)

    return asyncio.run(go())


def by_batch(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, float]]:
    """What the engine's step times (``TIMES``, by batch size) grew by between
    two settled readings (``SimWorker.settled``)."""
    return {size: {f: t.get(f, 0) - before.get(size, {}).get(f, 0) for f in TIMES}
            for size, t in after.items() if size != ASYNC}


def figures(before: dict[str, Any], after: dict[str, Any], batch: int, step_ms: float,
            jobs: int, max_new_tokens: int, tokens: int, elapsed_s: float,
            sleep_late_s: float | None = None) -> dict[str, Any]:
    """The run's figures from the engine's step times before and after it
    (``stats.gpu_sim``: ``StepTimes`` by batch size), the client's count and,
    when timed, how late a bare sleep of a step ends on this machine."""
    ideal = batch * 1000 / step_ms
    ahead = bool(after.get(ASYNC))
    grown = by_batch(before, after)
    full = grown.get(str(batch), {})
    steady: dict[str, Any] | None = None
    cycle = full.get("step_s", 0.0) + full.get("between_s", 0.0)
    if full.get("steps") and cycle > 0:
        made = full["tokens"] / cycle
        steady = {
            "steps": full["steps"], "tokens_per_s": round(made, 1),
            "of_ideal": round(made / ideal, 4), "async_scheduling": ahead,
            "in_step": round(full["step_s"] / cycle, 4),
            "in_device": round(full["device_s"] / cycle, 4),
            # The device step past the sleep asked for: the OS waking the thread
            # late, and the thread waiting for the GIL another thread holds.
            # Running ahead, the thread waits for the rest of a step it did not
            # sleep through, so there is no such share.
            "device_late": None if ahead else round(
                (full["device_s"] - full["steps"] * step_ms / 1000) / cycle, 4),
            "around_device": round((full["step_s"] - full["device_s"]) / cycle, 4),
            "between_steps": round(full["between_s"] / cycle, 4),
            # The device waiting for the engine thread to launch its next step.
            "device_idle": round(full["idle_s"] / cycle, 4),
        }
        if sleep_late_s is not None:  # the same sleeps' lateness, were it the bare one's
            steady["sleep_late"] = round(full["steps"] * sleep_late_s / cycle, 4)
    whole = tokens / elapsed_s if elapsed_s > 0 else 0.0
    return {
        "step_ms": step_ms, "batch": batch, "jobs": jobs, "max_new_tokens": max_new_tokens,
        "ideal_tokens_per_s": round(ideal, 1), "steady": steady,
        "whole_run": {"tokens": tokens, "elapsed_s": round(elapsed_s, 4),
                      "tokens_per_s": round(whole, 1), "of_ideal": round(whole / ideal, 4)},
        "engine_by_batch": grown,
    }


def lines(f: dict[str, Any]) -> Iterator[str]:
    """The figures of one run as the bench prints them."""
    head = f"gpu-sim step {f['step_ms']:g} ms batch {f['batch']}"
    steady, whole = f["steady"], f["whole_run"]
    if steady is None:
        yield (f"{head}: the batch never ran full (jobs ended before the last one started; "
               "raise --max-new-tokens)")
    else:
        yield f"{head}: {steady['tokens_per_s']:,.0f} tokens/s, {steady['of_ideal']:.3f} of ideal"
    yield (f"{head}, whole run with the ramp: {whole['tokens_per_s']:,.0f} tokens/s, "
           f"{whole['of_ideal']:.3f} of ideal")
    if steady is not None:
        yield (f"  engine thread at batch {f['batch']}: {steady['in_step']:.3f} of its wall time "
               f"inside step(), {steady['between_steps']:.3f} between steps (the hand-over to "
               "the output thread, waiting while it is behind)")
        if steady.get("async_scheduling"):
            yield (f"  one step ahead (async scheduling): {steady['in_device']:.3f} waiting for "
                   f"the device, {steady['around_device']:.3f} around the step (requests, ends "
                   "by token id) while the device runs the next; the device idle "
                   f"{steady['device_idle']:.3f} of the time")
        else:
            yield (f"  inside step(): {steady['in_device']:.3f} in the device step "
                   f"({steady['device_late']:.3f} of it past the sleep: waking, the GIL taken "
                   f"back), {steady['around_device']:.3f} around it (requests, ends by token "
                   f"id); the device idle {steady.get('device_idle', 0.0):.3f} of the time")
        if "sleep_late" in steady:
            yield (f"  a bare sleep of {f['step_ms']:g} ms on this machine ends late by "
                   f"{steady['sleep_late']:.3f} of the same time: the machine's part, not the "
                   "fleet's")
