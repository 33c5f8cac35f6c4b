"""``--modes gpu-sim --arrivals poisson``: traffic that arrives over time.

A GPU behind a queue is not handed its whole batch at once: jobs arrive one
by one, at random, and what the fleet costs shows as the device waiting for
work (goodput below what is offered) and as time to first token beyond the
engine's own. One worker of the gpu-sim engine (a step of ``--step-ms`` at
``--concurrency`` B) can make ``B x 1000 / step-ms`` tokens a second: with
jobs of ``--max-new-tokens`` T, ``B x 1000 / step-ms / T`` jobs a second is
its capacity. Jobs arrive as a Poisson process at ``--load`` of that (0.9:
90%) for ``--duration-s`` seconds, submitted by one asyncio client on the
schedule, each when its time comes. Then, from the job records (the fleet's
own clock, no client in the way):

- goodput: the tokens of the jobs that succeeded over the time from the first
  submit to the last end, against the offered tokens/s;
- TTFT (submit to first token) p50 and p99 against the engine's floor, one
  step (a new job's first token comes with the next step), and the part the
  fleet adds, in steps;
- how far the client fell behind its schedule (if it did, the load offered
  was less than asked, and the figures say so).

And the worker's admission rate: jobs a second it takes from the queue into
its batch. Its intake is paused (``control drain``), 4 batches of one-token
jobs are queued, and it is resumed: the jobs' starts (``started_at``) from the
first to the last give the rate, the client's submits out of it.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from tokenfleet import AsyncFleetClient
from tokenfleet.bench.gpu_sim_mode import ASYNC, TIMES as TIMES_BY_STEP, SimWorker, by_batch
from tokenfleet.bench.modes import BenchEnv
from tokenfleet.bench.procs import BenchError, Control
from tokenfleet.bench.workload import make_jobs, percentile
from tokenfleet.shared.settings import get_settings

Tick = Callable[[int], None]
Phase = Callable[[str, int], AbstractContextManager[Tick]]
ADMIT_BATCHES = 4  # one-token jobs queued for the admission rate, in batches of the worker
# Fields of a job record the figures come from.
TIMES = ("created_at", "started_at", "first_token_at", "finished_at")


def capacity_jobs_per_s(batch: int, step_ms: float, max_new_tokens: int) -> float:
    return batch * 1000 / step_ms / max_new_tokens


def poisson(n: int, rate: float, seed: int = 0) -> list[float]:
    """``n`` arrival times (seconds from the start) of a Poisson process of ``rate``."""
    rng = random.Random(seed)
    at, times = 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        times.append(at)
    return times


def ideal_queue(arrivals: list[float], batch: int, max_new_tokens: int,
                step_ms: float) -> dict[str, float | None]:
    """The TTFT a perfect fleet adds, in steps (p50, p99), for these arrivals in
    front of this device: ``batch`` slots, a job taking one at the first step
    that starts after it arrives and a slot is free (first come, first served),
    its first token at that step's end, its slot free again ``max_new_tokens``
    steps later. What is left is the queue's own: Poisson bursts that find
    every slot taken."""
    step_s = step_ms / 1000
    free_at = [0] * batch  # a heap of the step at which each slot is free
    added: list[float] = []
    for at in arrivals:
        first = max(math.ceil(at / step_s), heapq.heappop(free_at))
        heapq.heappush(free_at, first + max_new_tokens)
        added.append(first + 1 - at / step_s - 1)  # TTFT in steps, less the one-step floor
    p50, p99 = percentile(added, 50), percentile(added, 99)
    return {"added_ttft_p50_steps": None if p50 is None else round(p50, 2),
            "added_ttft_p99_steps": None if p99 is None else round(p99, 2)}


def run(env: BenchEnv, batch: int, max_new_tokens: int, step_ms: float, load: float,
        duration_s: float, phase: Phase) -> dict[str, Any]:
    """One gpu-sim worker at ``batch`` under Poisson arrivals at ``load`` of its
    capacity for ``duration_s``; then its admission rate."""
    rate = load * capacity_jobs_per_s(batch, step_ms, max_new_tokens)
    arrivals = poisson(max(1, round(rate * duration_s)), rate)
    prompts = [j.prompt for j in make_jobs(len(arrivals), max_new_tokens)]
    with SimWorker(env, batch, step_ms, phase, label="arrivals") as sim:
        warm = prompts[:batch]
        asyncio.run(_submit(env.redis_url, sim.namespace, warm, [0.0] * len(warm), 2))
        before = sim.settled(len(warm))
        with phase(f"arrivals c={batch} at {load:g} of capacity", len(arrivals)) as tick:
            ids, behind = asyncio.run(_submit(env.redis_url, sim.namespace, prompts, arrivals,
                                              max_new_tokens, tick))
        after = sim.settled(len(warm) + len(ids))
        records = _records(sim, ids)
        with phase(f"admission c={batch}", ADMIT_BATCHES * batch):
            admitted = _admission(env, sim, ADMIT_BATCHES * batch, len(warm) + len(ids))
    return {"step_ms": step_ms, "batch": batch, "max_new_tokens": max_new_tokens,
            "load": load, "duration_s": duration_s, "offered_jobs_per_s": round(rate, 1),
            "client_behind_s": round(behind, 4),
            **open_loop_figures(records, rate * max_new_tokens, max_new_tokens, step_ms),
            "device": device_figures(before, after, batch),
            "ideal_queue": ideal_queue(arrivals, batch, max_new_tokens, step_ms),
            "admission_jobs_per_s": admitted}


def device_figures(before: dict[str, Any], after: dict[str, Any], batch: int) -> dict[str, Any]:
    """What the device did between two settled readings (``SimWorker.settled``):
    its steps, the share of their slots that made a token for a running job,
    and the share of the engine thread's stepping time it stood idle."""
    grown = by_batch(before, after).values()
    totals = {name: sum(times[name] for times in grown) for name in TIMES_BY_STEP}
    cycles = totals["step_s"] + totals["between_s"]
    steps = int(totals["steps"])
    return {"steps": steps, "async_scheduling": bool(after.get(ASYNC)),
            "slots_used": round(totals["tokens"] / (steps * batch), 4) if steps else None,
            "idle": round(totals["idle_s"] / cycles, 4) if cycles > 0 else None}


def open_loop_figures(records: list[dict[str, Any]], offered_tokens_per_s: float,
                      max_new_tokens: int, step_ms: float) -> dict[str, Any]:
    """Goodput and TTFT from the jobs' records (``TIMES``, seconds, and ``status``)."""
    done = [r for r in records if r["status"] == "succeeded" and r["finished_at"]]
    tokens = len(done) * max_new_tokens  # gpu-sim jobs run to their length
    span = (max(r["finished_at"] for r in done) - min(r["created_at"] for r in records)
            if done else 0.0)
    goodput = tokens / span if span > 0 else 0.0
    ttft = [(r["first_token_at"] - r["created_at"]) * 1000 for r in done if r["first_token_at"]]
    p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
    # TTFT in two: waiting in the queue (submit to the worker's start), then
    # from the start to the first token (the engine's admission, its step, the output side).
    queued = [(r["started_at"] - r["created_at"]) * 1000 for r in done if r["started_at"]]
    started = [(r["first_token_at"] - r["started_at"]) * 1000 for r in done
               if r["first_token_at"] and r["started_at"]]

    def added_steps(ms: float | None) -> float | None:
        return None if ms is None else round(max(0.0, ms - step_ms) / step_ms, 2)

    return {"jobs": len(records), "succeeded": len(done),
            "offered_tokens_per_s": round(offered_tokens_per_s, 1),
            "goodput_tokens_per_s": round(goodput, 1),
            "goodput_of_offered": round(goodput / offered_tokens_per_s, 4),
            "ttft_p50_ms": p50 and round(p50, 2), "ttft_p99_ms": p99 and round(p99, 2),
            "ttft_floor_ms": step_ms,
            "queued_p50_ms": _round(percentile(queued, 50)),
            "queued_p99_ms": _round(percentile(queued, 99)),
            "start_to_first_p50_ms": _round(percentile(started, 50)),
            "start_to_first_p99_ms": _round(percentile(started, 99)),
            "added_ttft_p50_steps": added_steps(p50), "added_ttft_p99_steps": added_steps(p99)}


async def _submit(url: str, namespace: str, prompts: list[str], arrivals: list[float],
                  max_new_tokens: int, tick: Tick = lambda n: None) -> tuple[list[str], float]:
    """Submit each prompt at its arrival time: (job ids in order, the most the
    client fell behind its schedule, in seconds)."""
    settings = get_settings().model_copy(update={"require_worker": False})
    behind = 0.0
    async with AsyncFleetClient(url, namespace=namespace, settings=settings) as fleet:
        async def one(prompt: str) -> str:
            job_id = await fleet.submit(prompt, max_new_tokens=max_new_tokens, temperature=0.0)
            tick(1)
            return job_id

        started = time.perf_counter()
        tasks = []
        for prompt, at in zip(prompts, arrivals):
            wait = started + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            else:
                behind = max(behind, -wait)
            tasks.append(asyncio.create_task(one(prompt)))
        ids = await asyncio.gather(*tasks)
    return list(ids), behind


def _records(sim: SimWorker, ids: list[str]) -> list[dict[str, Any]]:
    """Each job's status and times, read in pipelines of a thousand."""
    out: list[dict[str, Any]] = []
    for at in range(0, len(ids), 1000):
        pipe = sim.redis.pipeline(transaction=False)
        for job_id in ids[at:at + 1000]:
            pipe.hmget(sim.keys.job(job_id), "status", *TIMES)
        for status, *times in pipe.execute():
            out.append({"status": status and status.decode(),
                        **{name: float(t) if t else None for name, t in zip(TIMES, times)}})
    return out


def _admission(env: BenchEnv, sim: SimWorker, n: int, ended_before: int) -> float | None:
    """Jobs a second the worker takes into its batch, from a full queue."""
    control = Control(env.redis_url, sim.keys)
    try:
        control.send("drain", [sim.node])
        try:
            prompts = [j.prompt for j in make_jobs(n, 1)]
            ids, _ = asyncio.run(_submit(env.redis_url, sim.namespace, prompts, [0.0] * n, 1))
        finally:
            control.send("resume", [sim.node])
    finally:
        control.close()
    sim.settled(ended_before + n)
    starts = sorted(r["started_at"] for r in _records(sim, ids) if r["started_at"])
    if len(starts) < n:
        raise BenchError(f"{n - len(starts)} of the admission run's jobs never started")
    # A read blocked in XREADGROUP when the drain came still hands over what the
    # first submits brought: the first batch's starts are left out.
    later = starts[n // ADMIT_BATCHES:]
    span = later[-1] - later[0] if len(later) > 1 else 0.0
    return round((len(later) - 1) / span, 1) if span > 0 else None


def lines(f: dict[str, Any]) -> list[str]:
    """The figures as the bench prints them."""
    head = f"arrivals: gpu-sim step {f['step_ms']:g} ms batch {f['batch']}"
    return [
        f"{head}, Poisson at {f['load']:g} of capacity ({f['offered_jobs_per_s']:,.0f} jobs/s x "
        f"{f['max_new_tokens']} tokens, {f['duration_s']:g} s, {f['jobs']:,} jobs): goodput "
        f"{f['goodput_tokens_per_s']:,.0f} tokens/s, {f['goodput_of_offered']:.3f} of the "
        f"{f['offered_tokens_per_s']:,.0f} offered",
        f"  TTFT p50 {_ms(f['ttft_p50_ms'])}, p99 {_ms(f['ttft_p99_ms'])} against the engine's "
        f"floor of {f['ttft_floor_ms']:g} ms (one step): the fleet adds "
        f"{f['added_ttft_p50_steps']} / {f['added_ttft_p99_steps']} steps (p50 / p99)",
        f"  of it: queued (submit to start) p50 {_ms(f.get('queued_p50_ms'))}, p99 "
        f"{_ms(f.get('queued_p99_ms'))}; start to first token p50 "
        f"{_ms(f.get('start_to_first_p50_ms'))}, p99 {_ms(f.get('start_to_first_p99_ms'))}",
        *_ideal_line(f.get("ideal_queue")),
        *_device_line(f.get("device")),
        f"  the client fell behind its schedule by at most {f['client_behind_s'] * 1000:,.1f} ms; "
        f"one worker admits {_num(f['admission_jobs_per_s'])} jobs/s from a full queue",
    ]


def _ideal_line(ideal: dict[str, Any] | None) -> list[str]:
    if not ideal:
        return []
    return [f"  a perfect fleet with the same arrivals (every slot used, a job in at the next "
            f"step) adds {ideal['added_ttft_p50_steps']} / {ideal['added_ttft_p99_steps']} "
            "steps: the queue's own part"]


def _device_line(device: dict[str, Any] | None) -> list[str]:
    if not device or not device["steps"]:
        return []
    ahead = "one step ahead" if device["async_scheduling"] else "one step at a time"
    return [f"  the device ({ahead}): {device['steps']:,} steps, {device['slots_used']:.3f} of "
            f"their slots made a job's token, idle {device['idle']:.3f} of the time"]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} ms"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
