"""One load through the official ``openai`` client, the same for every server.

``n`` greedy ``/v1/completions`` requests, all sent at once or at most
``concurrency`` at a time (the next sent as one ends, as ``vllm bench serve
--max-concurrency`` does), each asking for ``max_tokens`` tokens: plain (the
whole text in one answer) or streamed (a chunk per piece of text, the usage
last). Every request carries the same
fields, ones that both vLLM's server and the gateway take; a failed request
fails the run (no retries: a retry would hide a failure in the figures).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from tokenfleet.bench.procs import BenchError
from tokenfleet.bench.workload import Trace, summarize

TIMEOUT_S = 900.0


@dataclass
class LoadResult:
    figures: dict[str, Any]
    texts: list[str]  # each request's text, in prompt order


def run_load(base_url: str, model: str, prompts: list[str], max_tokens: int,
             stream: bool, concurrency: int | None = None) -> LoadResult:
    """``prompts`` against the server at ``base_url`` (its ``/v1``): all at
    once, or ``concurrency`` in flight."""
    return asyncio.run(_load(base_url, model, prompts, max_tokens, stream, concurrency))


async def _load(base_url: str, model: str, prompts: list[str], max_tokens: int,
                stream: bool, concurrency: int | None) -> LoadResult:
    from openai import AsyncOpenAI, OpenAIError

    n = len(prompts)
    in_flight = asyncio.Semaphore(concurrency or n)
    trace = Trace.empty(n, streamed=stream)
    texts = [""] * n
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0,
                         timeout=TIMEOUT_S)
    clock = time.perf_counter

    async def one(i: int) -> None:
        async with in_flight:
            await send(i)

    async def send(i: int) -> None:
        ask: dict[str, Any] = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens,
                               "temperature": 0.0}
        trace.submitted[i] = clock()
        if stream:
            chunks = await client.completions.create(
                **ask, stream=True, stream_options={"include_usage": True})
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].text:
                    trace.tokens[i].append(clock())
                    texts[i] += chunk.choices[0].text
                if chunk.usage is not None:
                    trace.num_tokens[i] = chunk.usage.completion_tokens
        else:
            answer = await client.completions.create(**ask)
            texts[i] = answer.choices[0].text
            trace.num_tokens[i] = answer.usage.completion_tokens if answer.usage else 0
        trace.ended[i] = clock()

    try:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), TIMEOUT_S)
    except (OpenAIError, TimeoutError) as exc:
        raise BenchError(f"a request to {base_url} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        await client.close()
    figures = summarize(trace, max_batch=min(n, concurrency or n), mean_batch=None,
                        occupancy=None)
    return LoadResult(figures, texts)
