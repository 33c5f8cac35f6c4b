"""The output side runs behind the engine: the engine hands over a step's token
ids and goes on to the next step, and the text, stop strings and ends come a
step or two later. A stop string found late still ends a job's text, its
token ids and its finish reason exactly where it ends them when the output is
made at once."""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest

from tokenfleet import FleetClient
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus, SamplingParams
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.bench.gpu_sim import TEXT, GpuSimEngine, build_gpu_sim
from tokenfleet.workers.output_processor import OutputProcessor, step
from tokenfleet.workers.sequence import Made, Sequence, SeqOutput
from tokenfleet.workers.service import Worker

from helpers import wait_until

JOBS = 200


def gpu_sim_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(TEXT, add_special_tokens=False))


def random_jobs(tokenizer: Any, n: int, seed: int) -> list[tuple[int, list[str]]]:
    """``n`` jobs as (max_new_tokens, stop strings): stops cut from the text the
    gpu-sim engine makes (across token boundaries, some at its very start),
    and some that never occur."""
    rng = random.Random(seed)
    text = tokenizer.decode(gpu_sim_ids(tokenizer) * 2, skip_special_tokens=True)
    jobs = []
    for _ in range(n):
        stops = []
        for _ in range(rng.randint(0, 3)):
            at = rng.choice([0, rng.randrange(len(text) - 10)])
            stops.append(text[at:at + rng.randint(1, 8)])
        if rng.random() < 0.3:
            stops.append("zq#")  # never made
        jobs.append((rng.randint(1, 90), stops))
    return jobs


def reference(tokenizer: Any, max_new_tokens: int,
              stops: list[str]) -> tuple[str, list[int], FinishReason]:
    """What a job of the gpu-sim engine ends with, from whole decodes: the first
    token after which the text holds a stop string ends it, the text cut where
    that stop starts; else the length limit."""
    ids = gpu_sim_ids(tokenizer)
    made = [ids[i % len(ids)] for i in range(max_new_tokens)]
    for k in range(1, max_new_tokens + 1):
        text = tokenizer.decode(made[:k], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)], made[:k], FinishReason.STOP
    return tokenizer.decode(made, skip_special_tokens=True), made, FinishReason.LENGTH


def sequence(tokenizer: Any, job_id: str, max_new_tokens: int, stops: list[str]) -> Sequence:
    return Sequence(job_id, tokenizer("a prompt")["input_ids"],
                    SamplingParams(max_new_tokens=max_new_tokens, stop=stops),
                    TextStream(tokenizer, stops))


def ends(outputs: list[SeqOutput]) -> dict[str, tuple[str, list[int], FinishReason | None]]:
    """Each job's text, the token ids up to its end, and its finish reason."""
    texts: dict[str, str] = {}
    result = {}
    for o in outputs:
        texts[o.seq.job_id] = texts.get(o.seq.job_id, "") + o.text
        if o.finished:
            last = len(o.seq.generated) if o.index is None else o.index + 1
            result[o.seq.job_id] = (texts[o.seq.job_id], o.seq.generated[:last],
                                    o.seq.finish_reason)
    return result


def test_a_stop_string_found_steps_after_the_engine_made_it_cuts_where_it_does_at_once() -> None:
    built = build_gpu_sim(Settings(max_batch=32, gpu_sim_step_ms=0.01))
    tokenizer = built.tokenizer
    jobs = random_jobs(tokenizer, 64, seed=3)

    at_once: GpuSimEngine = build_gpu_sim(Settings(max_batch=32, gpu_sim_step_ms=0.01)).engine
    for i, (n, stops) in enumerate(jobs):
        at_once.add(sequence(tokenizer, f"j{i}", n, stops))
    inline: list[SeqOutput] = []
    while at_once.has_work:
        inline += step(at_once)

    # The worker's output processor three steps behind the engine, as the
    # output thread is when it falls behind: the engine learns of a stop
    # string only once the processor has found it.
    behind: GpuSimEngine = built.engine
    processor = OutputProcessor(behind.forget, behind.stats)
    seqs = [sequence(tokenizer, f"j{i}", n, stops) for i, (n, stops) in enumerate(jobs)]
    for seq in seqs:
        behind.add(seq)
    queued: deque[list[Made]] = deque()
    late: list[SeqOutput] = []
    while behind.has_work or queued:
        if behind.has_work:
            queued.append(behind.advance())
        if len(queued) > 3 or not behind.has_work:
            late += processor.process(queued.popleft())

    assert ends(late) == ends(inline)
    assert len(ends(late)) == len(jobs)
    # The engine did run jobs past their stop strings: the case under test.
    assert any(len(seq.generated) > len(ends(late)[seq.job_id][1]) for seq in seqs)
    for i, (n, stops) in enumerate(jobs):
        assert ends(late)[f"j{i}"] == reference(tokenizer, n, stops), (n, stops)


def test_the_processor_releases_a_job_its_stop_string_ended_from_the_engine() -> None:
    # A stop string is found above the engine: unless the output processor
    # releases the job, the engine runs it on to its length limit, holding a
    # slot (and its cache) for tokens nobody stores.
    built = build_gpu_sim(Settings(max_batch=4, gpu_sim_step_ms=0.01))
    engine: GpuSimEngine = built.engine
    stop = built.tokenizer.decode(gpu_sim_ids(built.tokenizer)[:3], skip_special_tokens=True)
    engine.add(sequence(built.tokenizer, "j", 500, [stop[-2:]]))
    steps: list[list[SeqOutput]] = []
    processor = OutputProcessor(engine.forget, engine.stats, on_step=steps.append)
    ended: list[SeqOutput] = []
    while not ended:
        ended = [o for o in processor.process(engine.advance()) if o.finished]
    assert ended[0].seq.finish_reason is FinishReason.STOP
    assert engine.stats.jobs == {"succeeded": 1}
    engine.advance()  # the step at which the engine applies the release
    assert engine.num_held == 0 and not engine.has_work
    assert len(ended[0].seq.generated) < 20
    assert steps and steps[-1] and steps[-1][-1].finished


@pytest.mark.timeout(180)
def test_200_jobs_with_stop_strings_end_as_the_whole_text_says_through_a_worker(
        settings: Any, client: FleetClient) -> None:
    # 1 ms steps at batch 64: the engine runs ahead of the output thread.
    built = build_gpu_sim(settings.model_copy(update={"max_batch": 64, "gpu_sim_step_ms": 1}))
    worker = Worker(built.settings, built.engine, built.tokenizer, name="sim@test")
    worker.start()
    try:
        served = worker.keys.queue_workers(worker.queue)
        wait_until(lambda: worker.redis.zscore(served, "sim@test") is not None, timeout=30,
                   what="the worker's first heartbeat")
        jobs = random_jobs(built.tokenizer, JOBS, seed=11)
        job_ids = [client.submit("a prompt", max_new_tokens=n, stop=stops) for n, stops in jobs]
        states = [client.wait(j, timeout=120) for j in job_ids]
    finally:
        worker.stop(grace_s=0)
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * JOBS
    for (n, stops), state in zip(jobs, states, strict=True):
        text, token_ids, reason = reference(built.tokenizer, n, stops)
        assert (state.text, state.token_ids, state.finish_reason) == (text, token_ids, reason), \
            (n, stops)
