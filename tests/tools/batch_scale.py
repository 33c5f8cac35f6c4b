"""A batch at scale: a gateway process (its batch driver), one Celery worker on
the gpu-sim engine (no model: tokens cost a sleep) and a redis-server of its
own, all on this machine.

``memory``: for each N of ``--lines``, N lines uploaded through the openai
client and run to ``completed``, while the gateway's resident memory (its
process and children, /proc) and Redis's ``used_memory`` are sampled every
0.5 s; prints the peaks (and the figures before the upload) per N.

``throughput``: the same N requests as a batch, and submitted one by one at
once (``AsyncFleetClient.submit`` of each, all gathered, their records polled),
alternately, ``--repeat`` times each on one fleet; prints the medians of
lines/s and their ratio.

    python tests/tools/batch_scale.py memory --lines 5000,50000
    python tests/tools/batch_scale.py throughput --lines 2000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import orjson
import psutil
import redis

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.bench.procs import (CeleryProc, RedisProc, ServerProc, free_port,
                                           wait_for)

WORDS = "the value of a list is returned when the module calls its function".split()


@dataclass
class Fleet:
    redis_url: str
    namespace: str
    gateway: ServerProc
    worker: CeleryProc

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.gateway.url}/v1", api_key="unused",
                             max_retries=2, timeout=300)


@contextlib.contextmanager
def fleet(max_batch: int, step_ms: float, window: int) -> Iterator[Fleet]:
    """A redis-server, a gateway and a gpu-sim worker, stopped at the block's end."""
    redis_proc = RedisProc()
    namespace = f"scale{uuid.uuid4().hex[:8]}"
    files = tempfile.mkdtemp(prefix="tokenfleet-batch-scale-")
    common = {"TOKENFLEET_REDIS_URL": redis_proc.url, "TOKENFLEET_NAMESPACE": namespace,
              "TOKENFLEET_BATCH_WINDOW": str(window)}
    port = free_port()
    gateway = ServerProc("gateway", [sys.executable, "-m", "tokenfleet.cli.app", "gateway",
                                     "--host", "127.0.0.1", "--port", str(port)], port,
                         {**common, "TOKENFLEET_FILES_URL": f"file://{files}",
                          "TOKENFLEET_GATEWAY_AUTH": "off"})
    worker = CeleryProc("tokenfleet.workers.app", "sim@scale", {
        **common, "TOKENFLEET_ENGINE": "gpu-sim", "TOKENFLEET_MODEL": "tiny",
        "TOKENFLEET_QUEUE": "default",
        "TOKENFLEET_MAX_BATCH": str(max_batch), "TOKENFLEET_GPU_SIM_STEP_MS": str(step_ms),
        "TOKENFLEET_HEARTBEAT_S": "0.5", "TOKENFLEET_TORCH_THREADS": "1"})
    try:
        gateway.wait_ready("/healthz", lambda body: True, 120)
        r = redis.Redis.from_url(redis_proc.url)
        wait_for(lambda: r.exists(Keys(namespace).worker("sim@scale")) or not worker.alive(),
                 120, "the worker's first heartbeat")
        worker.check()
        r.close()
        yield Fleet(redis_proc.url, namespace, gateway, worker)
    finally:
        worker.close()
        gateway.close()
        redis_proc.close()


def lines(n: int, max_tokens: int, tag: str) -> bytes:
    out = io.BytesIO()
    for i in range(n):
        out.write(orjson.dumps({
            "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "default", "prompt": prompt(i), "max_tokens": max_tokens}}))
        out.write(b"\n")
    return out.getvalue()


def prompt(i: int) -> str:
    return f"{i} " + " ".join(WORDS[i % 7: i % 7 + 3])


class Sampler:
    """The gateway's RSS (its process and children) and Redis's used_memory,
    every ``every_s``, on a thread of its own; ``peaks`` and ``last``."""

    def __init__(self, gateway_pid: int, redis_url: str, every_s: float = 0.5) -> None:
        self.process = psutil.Process(gateway_pid)
        self.redis = redis.Redis.from_url(redis_url)
        self.every_s = every_s
        self.peak_rss = self.peak_redis = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[int, int]:
        rss = self.process.memory_info().rss + sum(
            c.memory_info().rss for c in self.process.children(recursive=True))
        used = int(self.redis.info("memory")["used_memory"])
        return rss, used

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, used = self.sample()
            self.peak_rss, self.peak_redis = max(self.peak_rss, rss), max(self.peak_redis, used)
            self.samples += 1
            self._stop.wait(self.every_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.redis.close()


def run_batch(oa: openai.OpenAI, data: bytes, timeout: float) -> tuple[Any, float, float]:
    """Upload, create, poll to the end: the batch, upload seconds, run seconds."""
    started = time.perf_counter()
    file_id = oa.files.create(file=("in.jsonl", data), purpose="batch").id
    uploaded = time.perf_counter()
    batch = oa.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                              completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        if time.perf_counter() - uploaded > timeout:
            raise TimeoutError(f"batch {batch.id} still {batch.status} after {timeout} s")
        time.sleep(0.1)
        batch = oa.batches.retrieve(batch.id)
    return batch, uploaded - started, time.perf_counter() - uploaded


def memory(args: argparse.Namespace) -> None:
    mib = 1 << 20
    rows = []
    for n in args.lines:
        with fleet(args.max_batch, args.step_ms, args.window) as f:
            data = lines(n, args.max_tokens, "m")
            sampler = Sampler(f.gateway.pid, f.redis_url)
            rss0, used0 = sampler.sample()
            with sampler:
                batch, upload_s, run_s = run_batch(f.openai(), data, args.timeout)
            rss1, used1 = sampler.sample()
            kinds = key_kinds(f.redis_url)
            keys = sum(kinds.values())
        counts = batch.request_counts
        rows.append((n, batch.status, counts.completed if counts else 0, upload_s, run_s,
                     rss0 / mib, sampler.peak_rss / mib, rss1 / mib,
                     used0 / mib, sampler.peak_redis / mib, used1 / mib, keys))
        print(f"lines {n}: {batch.status}, {rows[-1][2]} completed, upload {upload_s:.1f} s, "
              f"run {run_s:.1f} s ({n / run_s:.0f} lines/s); gateway RSS MiB before / peak / "
              f"after {rss0 / mib:.1f} / {sampler.peak_rss / mib:.1f} / {rss1 / mib:.1f}; "
              f"Redis used_memory MiB {used0 / mib:.1f} / {sampler.peak_redis / mib:.1f} / "
              f"{used1 / mib:.1f}; Redis keys after {keys} {dict(kinds.most_common(6))}; "
              f"{sampler.samples} samples",
              flush=True)
    print("\n| lines | status | run s | gateway RSS MiB before / peak / after "
          "| Redis used_memory MiB before / peak / after | Redis keys after |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, status, _, _, run_s, r0, r1, r2, u0, u1, u2, keys in rows:
        print(f"| {n:,} | {status} | {run_s:.0f} | {r0:.0f} / {r1:.0f} / {r2:.0f} "
              f"| {u0:.1f} / {u1:.1f} / {u2:.1f} | {keys} |")


def key_kinds(redis_url: str) -> Counter[str]:
    """Redis's keys by kind (the part after the namespace)."""
    r = redis.Redis.from_url(redis_url)
    kinds = Counter(k.decode().split(":")[1] for k in r.scan_iter(count=1000))
    r.close()
    return kinds


async def one_by_one(f: Fleet, n: int, max_tokens: int, tag: str) -> float:
    """Every request submitted at once (gathered), then their records polled
    every 0.1 s (as the batch's status is) until all ended: seconds."""
    async with AsyncFleetClient(f.redis_url, namespace=f.namespace) as client:
        started = time.perf_counter()
        ids = await asyncio.gather(*(client.submit(f"{tag} {prompt(i)}", max_new_tokens=max_tokens)
                                     for i in range(n)))
        while True:
            pipe = client.redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hget(client.keys.job(job_id), "status")
            statuses = await pipe.execute()
            if all(s not in (None, b"queued", b"running") for s in statuses):
                break
            await asyncio.sleep(0.1)
        elapsed = time.perf_counter() - started
    failed = [s for s in statuses if s != b"succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} jobs did not succeed: {failed[0]!r}")
    return elapsed


def throughput(args: argparse.Namespace) -> None:
    n = args.lines[0]
    batch_s: list[float] = []
    single_s: list[float] = []
    with fleet(args.max_batch, args.step_ms, args.window) as f:
        oa = f.openai()
        asyncio.run(one_by_one(f, min(n, 256), args.max_tokens, "warm"))  # first steps are slow
        for round_ in range(args.repeat):
            batch, upload_s, run_s = run_batch(oa, lines(n, args.max_tokens, f"b{round_}"),
                                               args.timeout)
            if batch.status != "completed":
                raise RuntimeError(f"batch ended {batch.status}")
            batch_s.append(run_s)
            single_s.append(asyncio.run(one_by_one(f, n, args.max_tokens, f"s{round_}")))
            print(f"round {round_ + 1}: batch {n / run_s:.0f} lines/s ({run_s:.2f} s, upload "
                  f"{upload_s:.2f} s not counted), one by one {n / single_s[-1]:.0f} lines/s "
                  f"({single_s[-1]:.2f} s)", flush=True)
    b, s = n / statistics.median(batch_s), n / statistics.median(single_s)
    print(f"\nmedian of {args.repeat}: batch {b:.0f} lines/s, one by one {s:.0f} lines/s, "
          f"batch / one by one {b / s:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("memory", "throughput"))
    parser.add_argument("--lines", default="5000,50000",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=256, help="the worker's")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the gpu-sim engine's step")
    parser.add_argument("--window", type=int, default=256, help="TOKENFLEET_BATCH_WINDOW")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    memory(args) if args.mode == "memory" else throughput(args)


if __name__ == "__main__":
    main()
