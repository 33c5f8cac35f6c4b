"""What log probabilities cost: tokens/s with them off and on, side by side.

``python -m tokenfleet.bench.logprobs_cost [--batch 16] [--jobs 64]
[--tokens 32] [--rounds 3] [--redis-url URL]``

Two measures, each in rounds that alternate off and on (every setting runs
once per round, in the same process, on the same jobs: drifts of a shared
machine fall on all of them alike):

- ``engine``: the built-in engine alone (the worker's runner and scheduler,
  ``step()`` with its text), ``--batch`` jobs at a time;
- ``fleet``: the same jobs through a worker in this process and Redis, submit
  to the last token stored, so the output side's cost counts too (token
  strings, the log's larger JSON, Redis). Skipped without ``--redis-url``.

Greedy decoding: every setting makes the same tokens. Prints one line per
round and setting, then the medians and their ratio to ``off``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from tokenfleet.shared import models
from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.shared.settings import Settings
from tokenfleet.bench.workload import Job, make_jobs
from tokenfleet.workers.output_processor import step

SETTINGS: dict[str, int | None] = {"off": None, "logprobs=5": 5, "top_logprobs=20": 20}


def engine_tokens_per_s(loaded: tuple[Any, Any], jobs: list[Job], batch: int,
                        logprobs: int | None) -> tuple[float, float]:
    from tokenfleet.workers.build import hf_engine, model_runner
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.sequence import Sequence

    model, tok = loaded
    settings = Settings(max_batch=batch, max_batch_tokens=batch * 1024, cpu_packed_linear=False)
    runner = model_runner(settings, model, tok)
    engine = hf_engine(settings, runner, runner.eos_token_ids, runner.max_model_len)
    waiting = [Sequence(f"j{i}", tok(job.prompt)["input_ids"],
                        SamplingParams(max_new_tokens=job.max_new_tokens, temperature=0.0,
                                       logprobs=logprobs), TextStream(tok))
               for i, job in enumerate(jobs)]
    tokens = 0
    with Timer() as timer:
        while waiting or engine.has_work:
            while waiting and engine.num_held < batch:
                engine.add(waiting.pop())
            tokens += sum(1 for out in step(engine) if out.token_id is not None)
    return timer.rates(tokens)


def fleet_tokens_per_s(loaded: tuple[Any, Any], jobs: list[Job], batch: int,
                       logprobs: int | None, redis_url: str) -> tuple[float, float]:
    from tokenfleet import FleetClient
    from tokenfleet.workers.build import hf_engine, model_runner
    from tokenfleet.workers.service import Worker

    model, tok = loaded
    settings = Settings(redis_url=redis_url, namespace=f"bench{uuid.uuid4().hex[:8]}",
                        queue="default", max_batch=batch, max_batch_tokens=batch * 1024, block_ms=20,
                        cpu_packed_linear=False)
    runner = model_runner(settings, model, tok)
    worker = Worker(settings, hf_engine(settings, runner, runner.eos_token_ids,
                                        runner.max_model_len), tok, name="bench@logprobs")
    worker.start()
    try:
        with FleetClient(settings=settings) as client, Timer() as timer:
            ids = [client.submit(job.prompt, max_new_tokens=job.max_new_tokens,
                                 temperature=0.0, logprobs=logprobs, require_worker=False)
                   for job in jobs]
            tokens = sum(len(client.wait(job_id, timeout=600).token_ids) for job_id in ids)
    finally:
        worker.stop(grace_s=0)
    with FleetClient(settings=settings) as client:
        for key in client.redis.scan_iter(match=f"{settings.namespace}:*"):
            client.redis.delete(key)
    return timer.rates(tokens)


class Timer:
    """Wall time and this process's CPU time (all its threads): on a shared
    machine the CPU time is the steadier measure of what the work costs."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu

    def rates(self, tokens: int) -> tuple[float, float]:
        """Tokens per second of wall time, and per second of CPU time."""
        return tokens / self.wall, tokens / self.cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    import torch

    from tokenfleet.workers.build import cpu_threads

    torch.set_num_threads(cpu_threads(Settings()))  # as a worker on this host
    loaded = models.load(args.model)
    jobs = make_jobs(args.jobs, args.tokens)
    measures: dict[str, Callable[[int | None], tuple[float, float]]] = {
        "engine": lambda lp: engine_tokens_per_s(loaded, jobs, args.batch, lp)}
    if args.redis_url:
        measures["fleet"] = lambda lp: fleet_tokens_per_s(loaded, jobs, args.batch, lp,
                                                          args.redis_url)
    engine_tokens_per_s(loaded, jobs[:args.batch], args.batch, 5)  # warm-up
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_ in range(1, args.rounds + 1):
        for measure, run in measures.items():
            for name, logprobs in SETTINGS.items():
                wall, cpu = run(logprobs)
                figures.setdefault((measure, name), []).append((wall, cpu))
                print(f"round {round_} {measure:6} {name:16} {wall:9.1f} tokens/s "
                      f"{cpu:9.1f} tokens/CPU-s", flush=True)
    print(f"\nmedians of {args.rounds} rounds, batch {args.batch}, {args.jobs} jobs of up to "
          f"{args.tokens} tokens ({args.model}, {torch.get_num_threads()} torch threads):")
    for measure in measures:
        off = [statistics.median(f) for f in zip(*figures[(measure, "off")])]
        for name in SETTINGS:
            wall, cpu = (statistics.median(f) for f in zip(*figures[(measure, name)]))
            print(f"{measure:6} {name:16} {wall:9.1f} tokens/s ({wall / off[0]:5.3f}x off)  "
                  f"{cpu:9.1f} tokens/CPU-s ({cpu / off[1]:5.3f}x off)")


if __name__ == "__main__":
    main()
