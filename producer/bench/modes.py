"""The benchmark's modes, each one run of the same jobs.

- ``Direct``: the runner, scheduler and engine in this process, no Redis: the
  model's own batched speed, the upper bound. Prompts are tokenized and tokens
  detokenized here too, as any server must.
- ``FleetSession``: a real ``celery -A tokenfleet.workers.app worker -P solo`` process
  (the model, or ``null`` for the overhead mode); jobs go in through
  ``FleetClient.submit`` and every event is timed as a subscriber hears it.
- ``NaiveSession``: ``celery -A tokenfleet.bench.naive_app worker -P solo``, one
  task per prompt, results through Celery's Redis result backend.
- ``publish_cost``: the worker-side cost of streaming, ``Publisher.publish``
  timed on its own.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.shared.wire.serialization import loads
from tokenfleet.shared.settings import Settings, get_settings
from tokenfleet.bench.procs import (
    BenchError,
    CeleryProc,
    Control,
    cpu_seconds,
    redis_cpu_seconds,
    rss_bytes,
    wait_for,
)
from tokenfleet.bench.redis_cost import cost, sample
from tokenfleet.bench.taps import EventTap, ResultTap
from tokenfleet.bench.workload import (Job, Trace, arrive, occupancy_from_stats, step_counts,
                                       summarize)
from tokenfleet.workers.output_processor import step

Tick = Callable[[int], None]


def _no_tick(n: int) -> None:
    pass


@dataclass(frozen=True)
class BenchEnv:
    """What every mode of one benchmark run shares."""

    redis_url: str
    model: str
    device: str
    threads: int
    run_id: str
    dtype: str = "auto"

    def namespace(self, label: str) -> str:
        return f"bench-{self.run_id}-{label}"

    def worker_env(self, namespace: str, model: str, max_batch: int) -> dict[str, str]:
        return {
            "TOKENFLEET_REDIS_URL": self.redis_url, "TOKENFLEET_NAMESPACE": namespace,
            "TOKENFLEET_MODEL": model, "TOKENFLEET_DEVICE": self.device,
            "TOKENFLEET_QUEUE": "default",  # the queue the bench's clients submit to
            "TOKENFLEET_DTYPE": self.dtype,
            "TOKENFLEET_TORCH_THREADS": str(self.threads),
            "TOKENFLEET_MAX_BATCH": str(max_batch), "TOKENFLEET_HEARTBEAT_S": "0.5",
            "TOKENFLEET_RESULT_TTL_S": "900",  # a benchmark's records need not stay a day
            "CUDA_VISIBLE_DEVICES": "" if self.device == "cpu" else "0",
        }


# -- direct ---------------------------------------------------------------------


class Direct:
    """The model in this process, with the same thread count as a worker's."""

    def __init__(self, model: str, device: str, threads: int, dtype: str = "auto") -> None:
        import torch

        from tokenfleet.shared import models

        if device == "cpu":
            torch.set_num_threads(threads)
        started = time.perf_counter()
        self.model, self.tokenizer = models.load(model, device, dtype)
        self._first_token()
        # From the files on disk to a first generated token, cold: how soon a
        # worker that starts could serve.
        self.load_and_first_token_s = round(time.perf_counter() - started, 3)
        self.settings = Settings(device=device)  # the worker's, for the same runner and scheduler
        self.prefetch = self.settings.prefetch

    def _first_token(self) -> None:
        """One greedy token of a short prompt, read back to the host (so a GPU's
        queued work is counted too)."""
        import torch

        ids = self.tokenizer("Hello", return_tensors="pt").input_ids.to(self.model.device)
        with torch.no_grad():
            self.model(input_ids=ids).logits[0, -1].argmax().item()

    def run(self, jobs: list[Job], max_batch: int, tick: Tick = _no_tick,
            closed_loop: bool = False) -> dict[str, Any]:
        """All of ``jobs`` through one engine; ``closed_loop``: one at a time."""
        from tokenfleet.workers import budget
        from tokenfleet.workers.build import hf_engine, model_runner
        from tokenfleet.workers.detokenizer import TextStream
        from tokenfleet.workers.sequence import Sequence

        tok = self.tokenizer
        runner = model_runner(self.settings, self.model, tok)
        # The worker's KV-token bound for this model, at the batch size of this run.
        sized = budget.resolve(self.settings, self.model, runner.max_model_len)
        settings = self.settings.model_copy(update={"max_batch": max_batch,
                                                    "max_batch_tokens": sized.max_batch_tokens})
        engine = hf_engine(settings, runner, runner.eos_token_ids, runner.max_model_len)

        def sequence(job_id: str, job: Job, max_new_tokens: int | None = None) -> Sequence:
            sampling = SamplingParams(max_new_tokens=max_new_tokens or job.max_new_tokens,
                                      temperature=0.0)
            return Sequence(job_id, tok(job.prompt)["input_ids"], sampling, TextStream(tok))

        warm = min(max_batch, len(jobs))  # the fleet's worker gets the same warm-up
        for i, job in enumerate(jobs[:warm]):
            engine.add(sequence(f"w{i}", job, 2))
        while engine.has_work:
            step(engine)
        before = engine.stats.as_dict()

        n = len(jobs)
        trace = Trace.empty(n)
        waiting = deque(range(n))
        # Like a worker's intake: the scheduler holds at most its batch plus the
        # prefetch; the rest waits outside (in the fleet, on the Redis stream).
        intake = max_batch + self.prefetch
        clock = time.perf_counter
        t0 = clock()
        while waiting or engine.has_work:
            now = clock()
            while waiting and t0 + jobs[waiting[0]].arrival_s <= now and not (
                    closed_loop and engine.has_work) and (
                    engine.num_held < intake):
                i = waiting.popleft()
                trace.submitted[i] = now if closed_loop else t0 + jobs[i].arrival_s
                engine.add(sequence(str(i), jobs[i]))
            if not engine.has_work:
                time.sleep(max(0.0, t0 + jobs[waiting[0]].arrival_s - clock()))
                continue
            outputs = step(engine)
            at = clock()
            for o in outputs:
                i = int(o.seq.job_id)
                if o.token_id is not None:
                    trace.tokens[i].append(at)
                if o.finished:
                    trace.ended[i] = at
                    tick(1)
        cap = min(max_batch, n)
        after = engine.stats.as_dict()
        mean, occupancy = occupancy_from_stats(before, after, n, cap)
        return summarize(trace, max_batch=cap, mean_batch=mean, occupancy=occupancy,
                         extra=step_counts(before, after))


# -- the fleet --------------------------------------------------------------------


class FleetSession:
    """One worker process of the fleet and a client that times its events."""

    def __init__(self, env: BenchEnv, label: str, model: str, max_batch: int,
                 record: bool = True, settings: dict[str, str] | None = None) -> None:
        self.namespace = env.namespace(label)
        self.keys = Keys(self.namespace)
        self.node = f"{label}@bench"
        self.max_batch = max_batch
        self.url = env.redis_url
        self._remote: Control | None = None  # remote control, made on first use
        self.redis = redis.Redis.from_url(env.redis_url)
        self.tap = EventTap(env.redis_url, self.keys, record=record)
        self.tap.on_end = self._ended
        # Jobs may be submitted before the worker's first heartbeat: queue ahead.
        self.client = FleetClient(env.redis_url, namespace=self.namespace,
                                  settings=get_settings().model_copy(
                                      update={"require_worker": False}))
        # ``settings``: the worker's own TOKENFLEET_* variables, over the bench's.
        self.worker = CeleryProc("tokenfleet.workers.app", self.node,
                                 {**env.worker_env(self.namespace, model, max_batch),
                                  **(settings or {})})
        self.last_ids: list[str] = []  # the jobs of the last run, in order
        self._count = 0
        self._target = 0
        self._tick: Tick = _no_tick
        self._all_done = threading.Event()
        self._awaited: bytes | None = None
        self._one_done = threading.Event()
        self.jobs_seen = 0  # jobs the worker has finished, as its stats last said
        try:
            wait_for(lambda: self.redis.exists(self.keys.worker(self.node))
                     or not self.worker.alive(), 300, f"worker {self.node} to start")
            self.worker.check()
        except BaseException:
            self.close()
            raise

    def _ended(self, job_id: bytes) -> None:  # on the tap's thread
        self._count += 1
        self._tick(1)
        if self._count >= self._target:
            self._all_done.set()
        if job_id == self._awaited:
            self._one_done.set()

    def stats(self) -> dict[str, Any]:
        raw = self.redis.hget(self.keys.worker(self.node), "stats")
        stats: dict[str, Any] = loads(raw) if raw else {}
        return stats

    def settled_stats(self, jobs: int) -> dict[str, Any]:
        """The worker's stats once its heartbeat counts ``jobs`` finished jobs."""
        stats: dict[str, Any] = wait_for(
            lambda: (s := self.stats()) and sum(s["jobs"].values()) >= jobs and s,
            30, f"the heartbeat of {self.node} to count {jobs} jobs")
        return stats

    def warm(self, jobs: list[Job]) -> None:
        """The first forward passes of a batch shape are slow: take them out of the figures."""
        self.run([Job(j.prompt, 2, 0.0) for j in jobs[:min(self.max_batch, len(jobs))]])

    def run(self, jobs: list[Job], tick: Tick = _no_tick, closed_loop: bool = False,
            timeout: float = 3600) -> dict[str, Any]:
        n = len(jobs)
        before = self.settled_stats(self.jobs_seen)
        cpu0, rcpu0 = cpu_seconds(self.worker.pid), redis_cpu_seconds(self.redis)
        redis0 = sample(self.redis)
        trace = Trace.empty(n)
        ids: list[bytes] = [b""] * n
        self._count, self._target, self._tick = 0, n, tick
        self._all_done.clear()
        clock = time.perf_counter
        t0 = clock()
        for i, job in enumerate(jobs):
            arrive(job, t0)
            self._one_done.clear()
            trace.submitted[i] = clock()
            ids[i] = self.client.submit(job.prompt, max_new_tokens=job.max_new_tokens,
                                        temperature=0.0).encode()
            if closed_loop:
                self._awaited = ids[i]
                if ids[i] not in self.tap.ended:
                    self._wait(self._one_done, timeout)
        self._wait(self._all_done, timeout)
        self._tick = _no_tick
        cpu1, rcpu1 = cpu_seconds(self.worker.pid), redis_cpu_seconds(self.redis)
        redis1 = sample(self.redis)
        self.jobs_seen += n
        self.last_ids = [job_id.decode() for job_id in ids]
        after = self.settled_stats(self.jobs_seen)
        for i, job_id in enumerate(ids):
            trace.tokens[i] = self.tap.tokens.pop(job_id, [])
            trace.ended[i] = self.tap.ended.pop(job_id, None)
        cap = min(self.max_batch, n)
        mean, occupancy = occupancy_from_stats(before, after, n, cap)
        figures = summarize(trace, max_batch=cap, mean_batch=mean, occupancy=occupancy,
                            extra=step_counts(before, after))
        figures["worker_cpu_s"] = round(cpu1 - cpu0, 3)
        figures["redis_cpu_s"] = round(rcpu1 - rcpu0, 3)
        figures.update(cost(redis0, redis1, figures["tokens"]))
        figures["worker_rss_mb"] = round(rss_bytes(self.worker.pid) / 2**20, 1)
        return figures

    def _wait(self, event: threading.Event, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not event.wait(1.0):
            self.worker.check()
            if time.monotonic() > deadline:
                raise BenchError(f"jobs on {self.node} did not finish in {timeout:.0f}s "
                                 f"({self._count}/{self._target} ended)")

    def prefilled(self, jobs: list[Job], tick: Tick = _no_tick) -> dict[str, Any]:
        """The worker's own pace: ``jobs`` wait on the queue while its intake is
        paused (``control drain``), then it takes them (``control resume``).
        Jobs per second counts from the first job's end to the last's, so
        neither the submitting client nor the pause is in the figure."""
        self._control("drain")
        # A read already blocked in XREADGROUP still hands over what the first
        # submits bring: those end early and are left out of the figure.
        self._count, self._target, self._tick = 0, len(jobs), tick
        self._all_done.clear()
        ids = [self.client.submit(j.prompt, max_new_tokens=j.max_new_tokens,
                                  temperature=0.0).encode() for j in jobs]
        resumed = time.perf_counter()
        self._control("resume")
        self._wait(self._all_done, 3600)
        self._tick = _no_tick
        self.jobs_seen += len(jobs)
        ends = sorted(self.tap.ended.pop(job_id) for job_id in ids)
        for job_id in ids:
            self.tap.tokens.pop(job_id, None)
        return _sustained([t for t in ends if t >= resumed])

    def _control(self, command: str) -> None:
        if self._remote is None:
            self._remote = Control(self.url, self.keys)
        self._remote.send(command, [self.node])

    def soak(self, jobs: list[Job], window: int, every_s: float = 0.5,
             tick: Tick = _no_tick) -> list[tuple[int, int]]:
        """Pass ``jobs`` through with at most ``window`` in flight; returns
        (jobs finished, worker RSS bytes) sampled every ``every_s``."""
        self._count, self._target, self._tick = 0, len(jobs), tick
        self._all_done.clear()
        samples = [(0, rss_bytes(self.worker.pid))]
        next_sample = time.monotonic() + every_s
        submitted = 0
        while submitted < len(jobs):
            if submitted - self._count < window:
                job = jobs[submitted]
                self.client.submit(job.prompt, max_new_tokens=job.max_new_tokens,
                                   temperature=0.0)
                submitted += 1
            else:
                time.sleep(0.001)
            if time.monotonic() >= next_sample:
                samples.append((self._count, rss_bytes(self.worker.pid)))
                next_sample += every_s
                self.worker.check()
        self._wait(self._all_done, 3600)
        self._tick = _no_tick
        samples.append((self._count, rss_bytes(self.worker.pid)))
        self.jobs_seen += len(jobs)
        return samples

    def close(self) -> None:
        self.worker.close()
        self.tap.close()
        self.client.close()
        self.redis.close()
        if self._remote is not None:
            self._remote.close()


# -- naive Celery -------------------------------------------------------------------


class NaiveSession:
    """The naive pattern's worker process and a client that times its results."""

    def __init__(self, env: BenchEnv, label: str = "naive") -> None:
        from tokenfleet.bench.naive_app import make_app

        namespace = env.namespace(label)
        self.app = make_app(env.redis_url, namespace)
        prefix = self.app.backend.task_keyprefix
        self.tap = ResultTap(env.redis_url, prefix.decode() if isinstance(prefix, bytes) else prefix)
        self.tap.on_result = self._result
        self.node = f"{label}@bench"
        self.worker = CeleryProc("tokenfleet.bench.naive_app", self.node,
                                 env.worker_env(namespace, env.model, 1))
        self._count = 0
        self._target = 0
        self._tick: Tick = _no_tick
        self._all_done = threading.Event()

    def _result(self, task_id: bytes) -> None:  # on the tap's thread
        self._count += 1
        self._tick(1)
        if self._count >= self._target:
            self._all_done.set()

    def warm(self, task: str) -> None:
        """Loads the model in the worker (its first task does) before the timing starts."""
        self.run(task, [Job("warm up", 2, 0.0)], timeout=600)

    def run(self, task: str, jobs: list[Job], tick: Tick = _no_tick,
            timeout: float = 3600) -> dict[str, Any]:
        n = len(jobs)
        trace = Trace.empty(n, streamed=False)
        ids: list[bytes] = [b""] * n
        self._count, self._target, self._tick = 0, n, tick
        self._all_done.clear()
        cpu0 = cpu_seconds(self.worker.pid)
        clock = time.perf_counter
        t0 = clock()
        for i, job in enumerate(jobs):
            arrive(job, t0)
            trace.submitted[i] = clock()
            ids[i] = self.app.send_task(task, args=[job.prompt, job.max_new_tokens]).id.encode()
        deadline = time.monotonic() + timeout
        while not self._all_done.wait(1.0):
            self.worker.check()
            if time.monotonic() > deadline:
                raise BenchError(f"naive tasks did not finish in {timeout:.0f}s "
                                 f"({self._count}/{n} done)")
        self._tick = _no_tick
        cpu1 = cpu_seconds(self.worker.pid)
        for i, task_id in enumerate(ids):
            when, meta = self.tap.results.pop(task_id)
            if meta["status"] != "SUCCESS":
                raise BenchError(f"naive task failed: {meta.get('result')}")
            trace.ended[i] = when
            trace.num_tokens[i] = int(meta["result"]["num_tokens"])
        figures = summarize(trace, max_batch=1, mean_batch=1.0, occupancy=1.0)
        figures["worker_cpu_s"] = round(cpu1 - cpu0, 3)
        return figures

    def prefilled(self, task: str, jobs: list[Job], tick: Tick = _no_tick) -> dict[str, Any]:
        """The worker's own pace, as for the fleet: the tasks wait in the broker
        while the worker consumes nothing (``cancel_consumer``), then it does."""
        queue = self.app.conf.task_default_queue
        self._control("cancel_consumer", queue)
        self._count, self._target, self._tick = 0, len(jobs), tick
        self._all_done.clear()
        ids = [self.app.send_task(task, args=[j.prompt, j.max_new_tokens]).id.encode()
               for j in jobs]
        resumed = time.perf_counter()
        self._control("add_consumer", queue)
        while not self._all_done.wait(1.0):
            self.worker.check()
        self._tick = _no_tick
        ends = sorted(self.tap.results.pop(task_id)[0] for task_id in ids)
        return _sustained([t for t in ends if t >= resumed])

    def _control(self, command: str, queue: str) -> None:
        replies = self.app.control.broadcast(command, arguments={"queue": queue},
                                             destination=[self.node], reply=True, timeout=10)
        if not replies:
            raise BenchError(f"worker {self.node} did not answer `control {command}`")

    def close(self) -> None:
        self.worker.close()
        self.tap.close()


def _sustained(ends: list[float]) -> dict[str, Any]:
    """Jobs per second between the first and the last end, over a full queue."""
    span = ends[-1] - ends[0] if len(ends) > 1 else 0.0
    return {"jobs": len(ends), "elapsed_s": round(span, 4),
            "jobs_per_s": round((len(ends) - 1) / span, 1) if span else 0.0}


# -- the cost of streaming, on its own -------------------------------------------------


def publish_cost(redis_url: str, namespace: str, tokenizer: Any, batch: int,
                 steps: int = 50) -> float:
    """Microseconds per token that a step's ``Publisher.send`` and ``collect``
    hold the engine for (building the script call, Redis appending to each log
    and publishing), for steps of ``batch`` tokens."""
    from tokenfleet.shared.redis.connect import connect
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.publisher import Publisher
    from tokenfleet.workers.sequence import SeqOutput
    from tokenfleet.workers.sequence import Sequence

    client = connect(redis_url)
    keys = Keys(namespace)
    publisher = Publisher(client, keys, Settings(redis_url=redis_url, namespace=namespace,
                                                 result_ttl_s=900), "micro@bench")
    seqs = [Sequence(f"m{batch}-{i}", [1], SamplingParams(), TextStream(tokenizer))
            for i in range(batch)]
    pipe = client.pipeline(transaction=False)
    for seq in seqs:
        pipe.hset(keys.job(seq.job_id), mapping={"status": "running", "attempts": 1})
        pipe.expire(keys.job(seq.job_id), 900)
    pipe.execute()
    token_id = tokenizer.encode("x", add_special_tokens=False)[0]
    steps_out = [[SeqOutput(s, index, token_id, "x", False) for s in seqs]
                 for index in range(steps + 1)]
    publisher.send(steps_out[0])  # index 0 also stamps first_token_at: not the steady state
    publisher.collect()
    clock = time.perf_counter
    t0 = clock()
    for outputs in steps_out[1:]:
        publisher.send(outputs)
        publisher.collect()
    elapsed = clock() - t0
    client.close()
    return elapsed / (steps * batch) * 1e6
