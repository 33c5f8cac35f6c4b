"""Where a streamed request's time to first token goes, on a fleet of its own.

A redis-server, one worker and the gateway (as ``tokenfleet bench --vs-vllm``
starts them), then bursts of ``--jobs`` streamed completions sent at once
through the official ``openai`` client. For each burst, from the first request
sent: when the jobs were created (``created_at`` of their records), handed to
the engine (``started_at``), made their first token (``first_token_at``), and
when the client saw its first text; and the CPU seconds of the gateway and the
worker.

    python tests/tools/trace_ttft.py --model tiny --jobs 64 --max-tokens 64 --bursts 4
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from contextlib import ExitStack, closing
from typing import Any

import redis

from tokenfleet.bench.modes import BenchEnv
from tokenfleet.bench.procs import RedisProc, cpu_seconds
from tokenfleet.bench.vs_vllm import QUEUE, Fleet
from tokenfleet.bench.workload import make_jobs


async def burst(url: str, prompts: list[str], max_tokens: int) -> tuple[float, list[float]]:
    """(when the first request went, when each request's first text came)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="trace", max_retries=0)
    firsts: list[float] = []

    async def one(prompt: str) -> None:
        chunks = await client.completions.create(model=QUEUE, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0.0, stream=True)
        first = None
        async for chunk in chunks:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.time()
        firsts.append(first if first is not None else time.time())

    sent = time.time()
    await asyncio.gather(*(one(p) for p in prompts))
    await client.close()
    return sent, firsts


def spread(values: list[float]) -> str:
    ordered = sorted(values)
    return (f"min {ordered[0]:6.0f}  p50 {ordered[len(ordered) // 2]:6.0f}  "
            f"max {ordered[-1]:6.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=4)
    args = parser.parse_args()
    with ExitStack() as stack:
        server = RedisProc()
        stack.callback(server.close)
        env = BenchEnv(server.url, args.model, "cpu", 1, uuid.uuid4().hex[:8])
        fleet = stack.enter_context(closing(Fleet(env, "hf", args.jobs, 1 << 28)))
        fleet.wait_ready()
        r: Any = redis.Redis.from_url(server.url, decode_responses=True)
        asyncio.run(burst(fleet.gateway.url, ["warm up"] * args.jobs, 2))
        for n in range(args.bursts):
            for key in r.scan_iter(f"{fleet.namespace}:job:*"):
                r.delete(key)
            prompts = [j.prompt for j in make_jobs(args.jobs, args.max_tokens, seed=100 + n)]
            cpu = cpu_seconds(fleet.gateway.pid), cpu_seconds(fleet.worker.pid)
            sent, firsts = asyncio.run(burst(fleet.gateway.url, prompts, args.max_tokens))
            records = [r.hgetall(k) for k in r.scan_iter(f"{fleet.namespace}:job:*")]
            print(f"burst {n}: gateway {cpu_seconds(fleet.gateway.pid) - cpu[0]:.2f} CPU s, "
                  f"worker {cpu_seconds(fleet.worker.pid) - cpu[1]:.2f} CPU s")
            for field in ("created_at", "started_at", "first_token_at"):
                times = [(float(rec[field]) - sent) * 1000 for rec in records if rec.get(field)]
                print(f"  {field:<15} {spread(times)}")
            print(f"  {'client sees':<15} {spread([(t - sent) * 1000 for t in firsts])}")


if __name__ == "__main__":
    main()
