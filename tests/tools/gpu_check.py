"""The GPU check of the built-in engine, one run: pinning, the memory budget, fleet vs direct.

Usage (on a GPU host with the worker extra installed and redis-server on PATH)::

    python tests/tools/gpu_check.py --out /tmp/gpu-check

1. Pinning: each process of ``tokenfleet worker``'s plan sees only its GPUs;
   then a real ``tokenfleet worker`` (``--max-batch auto``) serves one job, and
   nvidia-smi shows its one process on the GPU it was given.
2. The budget: what ``--max-batch auto`` gives the KV cache on this GPU
   (``gpu_memory_utilization`` of the free memory) against the memory the
   in-process engine took at its peak, and the fleet worker's memory from nvidia-smi.
3. ``tokenfleet bench`` modes direct and fleet at 64 and 256 concurrent jobs,
   the model in bfloat16.

Prints a short table last; every figure goes to ``<out>/gpu_check.json``.

On a lent machine whose image has torch but not this project: carry cp312 wheels
of the client's and Celery's dependencies and a redis-server, install the wheels
with ``pip install --no-deps --target``, and put a folder holding ``tokenfleet``
(``producer/``'s files plus ``shared/`` and ``workers/``) on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30


def smi(query: str, kind: str = "gpu") -> list[list[str]]:
    """nvidia-smi's CSV answer to ``--query-<kind>=query``, one list per row."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


class MemoryWatch:
    """Samples every process's GPU memory (MiB) while it runs; keeps each pid's peak."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            for pid, used in smi("pid,used_memory", "compute-apps"):
                if pid.isdigit() and used.isdigit():
                    self.peak[int(pid)] = max(self.peak.get(int(pid), 0), int(used))

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def pinning(model: str, say: Any) -> dict[str, Any]:
    """Each planned process sees only its GPUs; one real worker serves one job."""
    from tokenfleet import FleetClient
    from tokenfleet.bench.procs import RedisProc
    from tokenfleet.workers.pinning import plan, visible_gpus

    gpus = visible_gpus()
    seen = []
    code = ("import os, torch; print(os.environ['CUDA_VISIBLE_DEVICES'] or '-', "
            "torch.cuda.device_count(), torch.cuda.get_device_name(0) "
            "if torch.cuda.is_available() else 'cpu')")
    for proc in plan(gpus, host="h"):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **proc.env},
                             capture_output=True, text=True, timeout=120, check=True).stdout
        seen.append({"node": proc.node, "sees": out.strip()})
        say(f"  {proc.node}: CUDA_VISIBLE_DEVICES, device_count, name = {out.strip()}")

    redis = RedisProc()
    env = {**os.environ, "TOKENFLEET_REDIS_URL": redis.url, "TOKENFLEET_NAMESPACE": "gpucheck"}
    log = Path(os.environ.get("OUT", "/tmp")) / "gpu_check_worker.log"
    watch = MemoryWatch()
    with log.open("w") as sink:
        worker = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli.app", "worker",
                                   "--model", model, "--queue", "default",
                                   "--loglevel", "INFO"],
                                  env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        client = FleetClient(redis.url, namespace="gpucheck")
        started = time.monotonic()
        job = client.submit("Once upon a time", max_new_tokens=16, temperature=0.0,
                            require_worker=False)  # queued while the worker loads
        state = client.wait(job, timeout=300)
        served_s = time.monotonic() - started
        apps = smi("pid,used_memory", "compute-apps")
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        peaks = watch.stop()
        redis.close()
    text = log.read_text()
    budget_lines = [line.strip() for line in text.splitlines() if "KV tokens" in line]
    nodes = sorted({word for line in text.splitlines() for word in line.split()
                    if "-gpu" in word and "@" in word})
    say(f"  worker: job {state.status} in {served_s:.1f} s (load included); nodes {nodes}")
    for line in budget_lines[:1]:
        say(f"  budget: {line[line.find('max batch'):]}")
    say(f"  on the GPU during the job: {apps}; peak MiB by pid {peaks}")
    return {"planned": seen, "job_status": str(state.status), "served_s": served_s,
            "nodes": nodes, "budget_log": budget_lines[:1], "gpu_apps": apps,
            "peak_mib_by_pid": peaks}


def kv_budget(model_name: str, say: Any) -> dict[str, Any]:
    """The budget ``--max-batch auto`` computes here, before any run."""
    import torch

    from tokenfleet.shared import models
    from tokenfleet.shared.settings import Settings
    from tokenfleet.workers import budget

    model, _ = models.load(model_name, "cuda", "auto")
    weights = torch.cuda.memory_allocated()
    settings = Settings(device="cuda")
    longest = model.config.max_position_embeddings
    sized = budget.resolve(settings, model, longest, rows_at_longest=True)
    out = {"dtype": str(next(model.parameters()).dtype), "weights_gib": weights / GIB,
           "kv_bytes_per_token": sized.kv_bytes_per_token,
           "kv_budget_gib": sized.memory_bytes / GIB, "kv_budget_tokens": sized.max_batch_tokens,
           "auto_max_batch": sized.max_batch, "source": sized.source}
    say(f"  {out['dtype']}, weights {out['weights_gib']:.2f} GiB; KV budget "
        f"{out['kv_budget_gib']:.1f} GiB = {sized.max_batch_tokens:,} tokens of "
        f"{sized.kv_bytes_per_token:,} B; auto max batch {sized.max_batch} ({sized.source})")
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--jobs", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-check"))
    parser.add_argument("--skip", default="", help="parts to leave out: pinning,budget")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    skip = set(args.skip.split(","))
    figures: dict[str, Any] = {}

    def say(line: str) -> None:
        print(line, flush=True)

    for row in smi("name,memory.total,memory.used,driver_version"):
        say("GPU: " + ", ".join(row))
    import torch
    import transformers

    say(f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"cuda {torch.cuda.is_available()}")
    t0 = time.monotonic()
    if "pinning" not in skip:
        say("== pinning")
        figures["pinning"] = pinning(args.model, say)
        say(f"   ({time.monotonic() - t0:.0f} s)")
    if "budget" not in skip and args.device == "cuda":
        say("== budget")
        figures["budget"] = kv_budget(args.model, say)

    say("== bench: direct, fleet")
    from rich.console import Console

    from tokenfleet.bench.report import render
    from tokenfleet.bench.run import BenchConfig, run_bench

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    watch = MemoryWatch()
    results = run_bench(BenchConfig(model=args.model, jobs=args.jobs, concurrency=concurrency,
                                    max_new_tokens=args.max_new_tokens,
                                    modes=["direct", "fleet"], device=args.device,
                                    probe_jobs=10))
    peaks = watch.stop()
    figures["bench"] = results
    if args.device == "cuda":
        # The direct mode ran in this process: its peak is the weights plus the
        # engine's KV cache and activations at the largest batch.
        figures["direct_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        figures["gpu_peak_mib_by_pid"] = peaks
    (args.out / "gpu_check.json").write_text(json.dumps(figures, indent=2, default=str))
    render(results, Console(width=140))
    if "budget" in figures:
        b = figures["budget"]
        say(f"memory: weights {b['weights_gib']:.2f} GiB, KV budget {b['kv_budget_gib']:.1f} GiB; "
            f"direct peak {figures['direct_peak_gib']:.2f} GiB allocated; "
            f"processes' peak (nvidia-smi, MiB) {peaks}")
    say(f"total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
