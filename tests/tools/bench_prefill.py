"""The built-in engine in-process on a burst of jobs: when their first tokens come
and the tokens/s, for each prefill cap (``max_step_tokens``), caps taking turns.

    python tests/tools/bench_prefill.py --model tiny --jobs 64 --new 64 --caps 128,256,512,4096
    python tests/tools/bench_prefill.py --model llama-86m --jobs 32 --new 32 --kv-cache paged

The prompts are ``tokenfleet bench``'s (2-12 words); all jobs are handed over at
once, as a burst of requests reaches a worker. First-token figures are from the
handover, the best of ``--repeat`` bursts; tokens/s the best burst's.
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenfleet.shared import models
from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.shared.settings import Settings
from tokenfleet.bench.workload import make_jobs
from tokenfleet.workers.build import hf_engine, model_runner
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step


def burst(settings: Settings, runner: object, tok: object, jobs: int, new: int,
          seed: int) -> tuple[float, float, float]:
    """(first-token p50 ms, last first token ms, tokens/s) of one burst."""
    engine = hf_engine(settings, runner, runner.eos_token_ids,  # type: ignore[attr-defined]
                       runner.max_model_len)  # type: ignore[attr-defined]
    prompts = [j.prompt for j in make_jobs(jobs, new, seed=seed)]
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add(Sequence(f"b{seed}-{i}", tok(prompt)["input_ids"],  # type: ignore[operator]
                            SamplingParams(max_new_tokens=new, temperature=0.0), TextStream(tok)))
    firsts: dict[str, float] = {}
    tokens = 0
    while engine.has_work:
        for out in step(engine):
            if out.token_id is not None:
                tokens += 1
                firsts.setdefault(out.seq.job_id, time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    ordered = sorted(firsts.values())
    return ordered[len(ordered) // 2] * 1000, ordered[-1] * 1000, tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--new", type=int, default=64, help="tokens each job makes")
    parser.add_argument("--caps", default="128,256,512,4096")
    parser.add_argument("--kv-cache", default="rect", choices=["rect", "paged"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="times the caps take turns")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = models.load(args.model)
    runner = model_runner(Settings(kv_cache=args.kv_cache), model, tok)
    warm = Settings(kv_cache=args.kv_cache, max_batch=args.jobs, max_batch_tokens=10**6)
    burst(warm, runner, tok, args.jobs, 2, 99)  # the first passes of a shape are slow
    for _ in range(args.rounds):
        for cap in map(int, args.caps.split(",")):
            settings = Settings(kv_cache=args.kv_cache, max_batch=args.jobs,
                                max_batch_tokens=10**6, max_step_tokens=cap)
            runs = [burst(settings, runner, tok, args.jobs, args.new, seed)
                    for seed in range(args.repeat)]
            print(f"max_step_tokens {cap:5}: first token p50 {min(r[0] for r in runs):6.1f} ms, "
                  f"last {min(r[1] for r in runs):6.1f} ms, "
                  f"{max(r[2] for r in runs):7.1f} tokens/s")


if __name__ == "__main__":
    main()
