"""Fleet workers that differ in one setting, taking turns on the same jobs in one run.

Figures of separate runs on a shared machine differ by more than the effects
measured here, so each variant is a worker process of its own and the variants
run the jobs in turn, ``--repeat`` times; the best run of each is kept.

Usage::

    python tests/tools/bench_turns.py --model tiny --threads 1,2            # torch threads
    python tests/tools/bench_turns.py --model tiny --batches 32,256 --threads 1  # max batch
    python tests/tools/bench_turns.py --model tiny --threads 1,2 --direct   # and in-process

``--direct`` adds the in-process engine at each thread count (set_num_threads
between turns). The model may be a built-in name or a Hugging Face directory.
"""

from __future__ import annotations

import argparse
import json
import uuid
from typing import Any

import torch

from tokenfleet.bench.modes import BenchEnv, Direct, FleetSession
from tokenfleet.bench.procs import RedisProc
from tokenfleet.bench.workload import WORKLOADS, make_jobs

KEPT = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "mean_batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--jobs", type=int, default=64, help="jobs per run, all at once")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--workload", choices=WORKLOADS, default="uniform")
    parser.add_argument("--threads", default="1", help="torch threads, comma-separated")
    parser.add_argument("--batches", default=None,
                        help="max batch sizes, comma-separated (default: --jobs)")
    parser.add_argument("--direct", action="store_true", help="also the in-process engine")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.jobs]
    jobs = make_jobs(args.jobs, args.max_new_tokens, workload=args.workload)

    server = RedisProc()
    sessions: dict[str, FleetSession] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        run_id = uuid.uuid4().hex[:8]
        for t in threads:
            env = BenchEnv(server.url, args.model, "cpu", t, run_id)
            for b in batches:
                label = f"fleet-t{t}-b{b}"
                sessions[label] = FleetSession(env, label, args.model, b)
                sessions[label].warm(jobs)
        direct = Direct(args.model, "cpu", threads[0]) if args.direct else None
        for r in range(args.repeat):
            for t in threads:
                if direct is not None:
                    torch.set_num_threads(t)
                    if r == 0:
                        direct.run(jobs[:batches[0]], batches[0])  # warm this thread count
                    runs.setdefault(f"direct-t{t}-b{batches[0]}", []).append(
                        direct.run(jobs, batches[0]))
                for b in batches:
                    label = f"fleet-t{t}-b{b}"
                    runs.setdefault(label, []).append(sessions[label].run(jobs))
            print(f"turn {r + 1}: " + ", ".join(f"{k} {v[-1]['tokens_per_s']:.0f}"
                                                for k, v in runs.items()), flush=True)
    finally:
        for session in sessions.values():
            session.close()
        server.close()
    report = {"config": vars(args), "variants": {}}
    for label, figures in runs.items():
        best = max(figures, key=lambda f: f["tokens_per_s"])
        report["variants"][label] = {**{k: best[k] for k in KEPT},
                                     "runs": [f["tokens_per_s"] for f in figures]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
