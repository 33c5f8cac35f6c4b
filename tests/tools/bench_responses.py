"""``/v1/responses`` streamed against ``/v1/chat/completions`` streamed, on the same
fleet, the same load, in alternating rounds: time to first token and tokens/s.

One worker (``tokenfleet.workers.app``, Celery) and one gateway (``tokenfleet
gateway``) on a Redis of the run's own; each round sends ``--concurrency``
requests at once through the official ``openai`` client, all of one route,
each for ``--max-tokens`` tokens (``ignore_eos``: every request makes them
all), and the routes take turns, so a load on the machine falls on both alike.
The medians of the rounds and their ratio (responses / chat) are printed.

Usage::

    python tests/tools/bench_responses.py --model tiny --concurrency 32 --max-tokens 64 --rounds 5
    python tests/tools/bench_responses.py ... --client raw   # without the openai package's parsing
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from typing import Any

from tokenfleet.bench.modes import BenchEnv
from tokenfleet.bench.procs import CeleryProc, RedisProc, ServerProc, free_port, wait_for
from tokenfleet.bench.workload import Trace, summarize
from tokenfleet.shared.wire.keys import Keys

QUEUE = "bench"
ROUTES = ("chat", "responses")


async def raw_round(base_url: str, route: str, n: int, max_tokens: int) -> dict[str, Any]:
    """As :func:`one_round`, read with httpx and orjson: the servers' side alone,
    without the openai package's parsing of each event."""
    import httpx
    import orjson

    trace = Trace.empty(n)
    clock = time.perf_counter
    body: dict[str, Any] = {"model": QUEUE, "temperature": 0.0, "stream": True,
                            "ignore_eos": True}
    if route == "chat":
        path = "/chat/completions"
        body.update(max_tokens=max_tokens, stream_options={"include_usage": True})
    else:
        path = "/responses"
        body.update(max_output_tokens=max_tokens)

    async def timed(i: int, http: httpx.AsyncClient) -> None:
        ask = {**body, **({"messages": [{"role": "user", "content": f"Story {i}."}]}
                          if route == "chat" else {"input": f"Story {i}."})}
        trace.submitted[i] = clock()
        async with http.stream("POST", base_url + path, json=ask) as got:
            async for line in got.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = orjson.loads(line[6:])
                if route == "chat":
                    if data.get("choices") and data["choices"][0]["delta"].get("content"):
                        trace.tokens[i].append(clock())
                    if data.get("usage"):
                        trace.num_tokens[i] = data["usage"]["completion_tokens"]
                elif data["type"] == "response.output_text.delta":
                    trace.tokens[i].append(clock())
                elif data["type"] in ("response.completed", "response.incomplete"):
                    trace.num_tokens[i] = data["response"]["usage"]["output_tokens"]
        trace.ended[i] = clock()

    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await asyncio.gather(*(timed(i, http) for i in range(n)))
    return summarize(trace, max_batch=n, mean_batch=None, occupancy=None)


async def one_round(base_url: str, route: str, n: int, max_tokens: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=600)
    trace = Trace.empty(n)
    clock = time.perf_counter

    async def chat(i: int) -> None:
        chunks = await client.chat.completions.create(
            model=QUEUE, messages=[{"role": "user", "content": f"Story {i}."}],
            max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                trace.tokens[i].append(clock())
            if chunk.usage is not None:
                trace.num_tokens[i] = chunk.usage.completion_tokens

    async def responses(i: int) -> None:
        events = await client.responses.create(
            model=QUEUE, input=f"Story {i}.", max_output_tokens=max_tokens, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True})
        async for event in events:
            if event.type == "response.output_text.delta" and event.delta:
                trace.tokens[i].append(clock())
            elif event.type in ("response.completed", "response.incomplete"):
                assert event.response.usage is not None
                trace.num_tokens[i] = event.response.usage.output_tokens

    async def timed(i: int) -> None:
        trace.submitted[i] = clock()
        await (chat if route == "chat" else responses)(i)
        trace.ended[i] = clock()

    await asyncio.gather(*(timed(i) for i in range(n)))
    await client.close()
    return summarize(trace, max_batch=n, mean_batch=None, occupancy=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each route")
    parser.add_argument("--client", choices=("openai", "raw"), default="openai",
                        help="the openai package, or httpx and orjson (the servers' side alone)")
    args = parser.parse_args()
    load = one_round if args.client == "openai" else raw_round

    server = RedisProc()
    env = BenchEnv(server.url, args.model, "cpu", 1, uuid.uuid4().hex[:8])
    namespace = env.namespace("responses")
    node = "responses@bench"
    worker = CeleryProc("tokenfleet.workers.app", node, {
        **env.worker_env(namespace, args.model, args.concurrency), "TOKENFLEET_QUEUE": QUEUE})
    port = free_port()
    gateway = ServerProc("gateway", [sys.executable, "-m", "tokenfleet.cli.app", "gateway",
                                     "--port", str(port)], port,
                         {"TOKENFLEET_REDIS_URL": server.url, "TOKENFLEET_NAMESPACE": namespace})
    rounds: dict[str, list[dict[str, Any]]] = {route: [] for route in ROUTES}
    try:
        import redis

        r = redis.Redis.from_url(server.url)
        wait_for(lambda: r.exists(Keys(namespace).worker(node)) or not worker.alive(), 300,
                 "the worker to start")
        worker.check()
        gateway.wait_ready("/v1/models", lambda body: QUEUE.encode() in body, 60)
        base_url = f"{gateway.url}/v1"
        for route in ROUTES:  # warm both paths
            asyncio.run(load(base_url, route, 2, 4))
        for turn in range(args.rounds):
            order = ROUTES if turn % 2 == 0 else ROUTES[::-1]
            for route in order:
                cpu = time.process_time()
                figures = asyncio.run(load(base_url, route, args.concurrency, args.max_tokens))
                # This process's CPU per request: the client's own parsing, on the
                # same cores as the fleet.
                figures["client_cpu_ms"] = (time.process_time() - cpu) * 1000 / args.concurrency
                rounds[route].append(figures)
            print(f"round {turn + 1}: " + ", ".join(
                f"{route} {rounds[route][-1]['tokens_per_s']:.0f} tok/s, TTFT p50 "
                f"{rounds[route][-1]['ttft_p50_ms']} ms" for route in ROUTES), flush=True)
    finally:
        gateway.close()
        worker.close()
        server.close()
    medians = {route: {k: statistics.median(f[k] for f in figures)
                       for k in ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "client_cpu_ms")}
               for route, figures in rounds.items()}
    ratios = {k: round(medians["responses"][k] / medians["chat"][k], 3)
              for k in medians["chat"]}
    print(json.dumps({"config": vars(args), "medians": medians,
                      "responses_over_chat": ratios}, indent=2))


if __name__ == "__main__":
    main()
