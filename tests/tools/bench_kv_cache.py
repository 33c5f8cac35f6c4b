"""The built-in engine's two KV caches side by side, in one process, on the
same jobs (``tokenfleet bench``'s direct mode, run once per cache in turns).

    python tests/tools/bench_kv_cache.py --model tiny --jobs 128 --concurrency 64

Two loads: ``short`` (the bench's own jobs, all at once) and ``long`` (the same
arriving at a fixed rate, with a few prompts of ``--long-tokens`` tokens among
them: what chunked prefill is for; watch the ITL p99).
"""

from __future__ import annotations

import argparse
import json

from tokenfleet.bench.modes import Direct
from tokenfleet.bench.workload import WORDS, Job, make_jobs


def long_prompt(tokenizer: object, tokens: int) -> str:
    words: list[str] = []
    while len(tokenizer(" ".join(words))["input_ids"]) < tokens:  # type: ignore[operator]
        words.extend(WORDS)
    while len(tokenizer(" ".join(words))["input_ids"]) > tokens:  # type: ignore[operator]
        words.pop()
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--jobs", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rate", type=float, default=40.0, help="jobs/s of the long load")
    parser.add_argument("--long", type=int, default=4, help="long prompts in the long load")
    parser.add_argument("--long-tokens", type=int, default=900)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--caches", default="rect,paged")
    parser.add_argument("--loads", default="short,long")
    args = parser.parse_args()

    direct = Direct(args.model, "cpu", args.threads)
    short = make_jobs(args.jobs, args.max_new_tokens)
    text = long_prompt(direct.tokenizer, args.long_tokens)
    long = [Job(text if i % max(1, args.jobs // args.long) == args.jobs // (2 * args.long)
                else j.prompt, j.max_new_tokens, i / args.rate)
            for i, j in enumerate(short)]
    loads = {"short": short, "long": long}
    keep = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "mean_batch")
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeat):
        for load in args.loads.split(","):
            for cache in args.caches.split(","):
                direct.settings = direct.settings.model_copy(update={"kv_cache": cache})
                figures = direct.run(loads[load], args.concurrency)
                label = f"{load:5} {cache:5}"
                print(label, json.dumps({k: figures.get(k) for k in keep}), flush=True)
                old = best.get(label)
                if old is None or figures["tokens_per_s"] > old["tokens_per_s"]:
                    best[label] = {k: figures.get(k) for k in keep}
    print("best of", args.repeat)
    for label, figures in best.items():
        print(label, json.dumps(figures))


if __name__ == "__main__":
    main()
