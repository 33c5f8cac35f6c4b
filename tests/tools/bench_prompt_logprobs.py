"""Prefill cost of prompt log probabilities: a batch of prompts prefilled (and
one token sampled) with ``prompt_logprobs`` on and off, on the built-in engine,
both runners, the tiny model's shape and the 86M shape; prints the ratio.

    python tests/tools/bench_prompt_logprobs.py [--batch 16] [--tokens 128] [--shapes tiny-random,llama-86m]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tokenfleet.shared import models, synthetic
from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.paged_runner import PagedRunner
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step


def prefill_s(runner: Any, prompts: list[list[int]], ask: int | None) -> float:
    """Seconds to run the batch's prefill (one step: each job wants one token)."""
    engine = HFEngine(Scheduler(max_batch=len(prompts), eos_token_ids=runner.eos_token_ids,
                                max_model_len=runner.max_model_len), runner)
    seqs = [Sequence(f"b{i}", ids, SamplingParams(max_new_tokens=1, temperature=0.0,
                                                   prompt_logprobs=ask),
                     TextStream(runner.tokenizer))
            for i, ids in enumerate(prompts)]
    for seq in seqs:
        engine.add(seq)
    started = time.perf_counter()
    step(engine)
    took = time.perf_counter() - started
    assert all(len(s.generated) == 1 for s in seqs)
    assert all((s.prompt_logprobs is not None) == (ask is not None) for s in seqs)
    while engine.has_work:
        step(engine)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=1, help="prompt_logprobs (lm-eval asks 1)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", default="tiny-random,llama-86m")
    args = parser.parse_args()
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model, tok = models.load(str(synthetic.write(shape, Path(tmp) / shape)))
        prompts = torch.randint(3, len(tok), (args.batch, args.tokens)).tolist()
        for runner_class in (HFRunner, PagedRunner):
            runner = runner_class(model, tok)
            prefill_s(runner, prompts, None)  # warm up
            off, on = [], []
            for _ in range(args.reps):  # interleaved: the machine's load hits both alike
                off.append(prefill_s(runner, prompts, None))
                on.append(prefill_s(runner, prompts, args.top))
            off_s, on_s = statistics.median(off), statistics.median(on)
            print(f"{shape:12} {runner_class.__name__:12} batch {args.batch} x {args.tokens} "
                  f"tokens, vocab {len(tok)}: off {off_s * 1e3:8.1f} ms  on {on_s * 1e3:8.1f} ms"
                  f"  ratio {on_s / off_s:.2f}x", flush=True)


if __name__ == "__main__":
    main()
