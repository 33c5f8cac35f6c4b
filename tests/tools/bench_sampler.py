"""The sampler alone, against its version at a git revision, side by side in one process.

Usage::

    python tests/tools/bench_sampler.py --ref b4a992f            # ms per call, old / new
    python tests/tools/bench_sampler.py --ref b4a992f --profile  # cProfile of a mixed batch

Rows of each batch: greedy; temperature only; seeded; mixed (greedy, temperatures,
top-p 0.9, top-k 40, half seeded); repetition penalty over 220 tokens of text.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import subprocess
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.workers import sampler
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.sequence import Sequence

ROOT = Path(__file__).resolve().parents[2]
MIXES = ("greedy", "temp", "seeded", "mixed", "penalty")


def old_sampler(ref: str) -> types.ModuleType:
    source = subprocess.run(["git", "show", f"{ref}:workers/sampler.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType(f"sampler_{ref}")
    exec(compile(source, f"{ref}:workers/sampler.py", "exec"), module.__dict__)
    return module


def params(mix: str, i: int, rng: random.Random) -> SamplingParams:
    if mix == "greedy":
        return SamplingParams(temperature=0.0)
    if mix == "temp":
        return SamplingParams(temperature=0.8)
    if mix == "seeded":
        return SamplingParams(temperature=0.8, seed=i)
    if mix == "penalty":
        return SamplingParams(temperature=0.8, repetition_penalty=1.2)
    return SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                          top_k=rng.choice([0, 40]), seed=rng.choice([None, i]))


def batch(rows: int, mix: str, vocab: int) -> list[Sequence]:
    rng = random.Random(0)
    seqs = []
    for i in range(rows):
        seq = Sequence(f"s{i}", [rng.randrange(vocab) for _ in range(200)], params(mix, i, rng),
                       TextStream(None))
        seq.generated = [rng.randrange(vocab) for _ in range(20)]
        seq.rng = None  # type: ignore[attr-defined]  # the old sampler's generator slot
        seqs.append(seq)
    return seqs


def ms_per_call(fn: Callable[..., Any], logits: torch.Tensor, seqs: list[Sequence]) -> float:
    reps = max(3, int(2e6 / logits.numel()))
    fn(logits.clone(), seqs)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(reps):
            fn(logits.clone(), seqs)
        best = min(best, (time.perf_counter() - started) / reps * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", required=True, help="the git revision of the old sampler")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    old = old_sampler(args.ref)
    print(f"{'vocab':>6} {'rows':>4} {'mix':>8} {'old ms':>8} {'new ms':>8} {'old/new':>7}")
    for vocab in (1024, 32000):
        for rows in (8, 64, 256):
            for mix in MIXES:
                logits, seqs = torch.randn(rows, vocab), batch(rows, mix, vocab)
                before = ms_per_call(old.sample, logits, seqs)
                after = ms_per_call(sampler.sample, logits, seqs)
                print(f"{vocab:>6} {rows:>4} {mix:>8} {before:8.3f} {after:8.3f} "
                      f"{before / after:7.2f}", flush=True)
    if args.profile:
        logits, seqs = torch.randn(64, 32000), batch(64, "mixed", 32000)
        for name, fn in (("old", old.sample), ("new", sampler.sample)):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(20):
                fn(logits.clone(), seqs)
            profile.disable()
            print(f"== {name}")
            pstats.Stats(profile).sort_stats("tottime").print_stats(6)


if __name__ == "__main__":
    main()
