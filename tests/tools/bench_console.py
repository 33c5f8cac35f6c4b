"""The console's fleet and batch pages against a Redis full of finished jobs:
a page load must read Redis in O(shown rows), not O(jobs), so its time is the
same with 1,000 finished jobs as with 100,000.

For each size, a namespace of its own gets the jobs in the shape the fleet
stores them (the record ``finish.lua`` leaves, a token log of one token event
and the end, both with the result TTL), 200 ended batches, the declared queue
``default`` with its streams' groups, 4 live workers' heartbeats and their 15
minutes of history samples. The gateway (``server_config``: the app and the
HTTP protocol ``tokenfleet gateway`` serves) runs in a thread of this process
on a free port; each page, as HTML and as JSON, is asked ``--requests`` times
after 3 warm-ups, one request at a time over one keep-alive connection, and
p50 / p95 / max are printed beside Redis's DBSIZE, with the Redis calls a load
made (``INFO commandstats``). The gateway's own loops run meanwhile, as they do
in production (the batch driver's poll, the webhook deliverer's, whose discovery
SCANs the keyspace): their calls count in the loads they overlap, SCAN and KEYS
apart, so a figure that grows with the jobs shows where it comes from.

Usage::

    python tests/tools/bench_console.py                      # 1,000 then 100,000 jobs
    python tests/tools/bench_console.py --jobs 200000 --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
import uuid
from typing import Any

import httpx
import orjson
import redis
import redis.asyncio
import uvicorn

from tokenfleet.bench.procs import RedisProc, free_port, wait_for
from tokenfleet.client.batch_records import create_batch
from tokenfleet.gateway.app import server_config
from tokenfleet.gateway.console.reads import ROWS
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire import fleet_history
from tokenfleet.shared.wire.batch_scripts import batch_move
from tokenfleet.shared.wire.declared import declare
from tokenfleet.shared.wire.keys import GROUP, PRIORITIES, Keys, new_job_id
from tokenfleet.shared.wire.schemas import (
    FinishReason, GenerationRequest, JobStatus, SamplingParams)
from tokenfleet.shared.wire.serialization import end_event, token_event
from tokenfleet.shared.wire.topology import level_stream

QUEUE = "default"
TENANTS = ("acme", "globex", "initech")  # the jobs' and batches' owners, in turn
WORKERS = 4
BATCHES = 200
PIPELINE = 1000  # jobs per pipeline while filling
RESULT_TTL_S = 24 * 3600  # Settings.result_ttl_s's default
WARM_UPS = 3
TARGET_MS = 200.0
PAGES = (("fleet", "/console"), ("batch", "/console/batches"))
ACCEPT = {"html": "text/html,application/xhtml+xml,*/*;q=0.8", "json": "application/json"}


def fill_jobs(r: redis.Redis, keys: Keys, count: int, now: float) -> None:
    """``count`` finished jobs: each its record as submit, start, the first
    emit and finish leave it, and its token log (one token event, then the
    end at '1-0'), both expiring as finish.lua makes them."""
    tokens = list(range(1000, 1016))
    texts = [f" w{t}" for t in tokens]
    text = "".join(texts)
    event = token_event(0, tokens, texts, prompt_tokens=7)
    end = end_event(JobStatus.SUCCEEDED, FinishReason.LENGTH, None)
    token_ids = orjson.dumps(tokens)
    pipe = r.pipeline(transaction=False)
    for i in range(count):
        job_id = new_job_id(QUEUE, uuid.uuid4().hex)
        tenant = TENANTS[i % len(TENANTS)]
        created = now - 3600 + 3600 * i / count  # spread over the last hour
        request = GenerationRequest(prompt=f"Story {i}.", tenant=tenant,
                                    sampling=SamplingParams(max_new_tokens=len(tokens)))
        pipe.hset(keys.job(job_id), mapping={
            "id": job_id, "status": JobStatus.SUCCEEDED.value, "model": QUEUE,
            "priority": "normal", "created_at": repr(created), "attempts": 1,
            "metadata": b"{}", "request": request.model_dump_json(exclude_defaults=True),
            "tenant": tenant, "entry": f"{int(created * 1000)}-0", "weight": 23,
            "worker": f"w{i % WORKERS}@bench", "started_at": repr(created + 0.01),
            "first_token_at": repr(created + 0.05), "finish_reason": FinishReason.LENGTH.value,
            "error": "", "text": text, "token_ids": token_ids,
            "num_prompt_tokens": 7, "finished_at": repr(created + 0.4)})
        pipe.expire(keys.job(job_id), RESULT_TTL_S)
        # A token entry's id is the index after its last token (first attempt).
        pipe.xadd(keys.out(job_id), {"e": event}, id=f"0-{len(tokens)}")
        pipe.xadd(keys.out(job_id), {"e": end}, id="1-0")
        pipe.expire(keys.out(job_id), RESULT_TTL_S)
        if (i + 1) % PIPELINE == 0:
            pipe.execute()
    pipe.execute()


async def fill_batches(url: str, keys: Keys, count: int) -> None:
    """``count`` batches made as the batch API makes them, then ended as a
    driver ends them (``batch_move``, and out of the active and open sets):
    ended ones, so that no driver takes them up while the pages are timed."""
    client = redis.asyncio.Redis.from_url(url)
    try:
        for i in range(count):
            tenant = TENANTS[i % len(TENANTS)]
            batch = await create_batch(
                client, keys, input_file_id=f"file-{uuid.uuid4().hex[:24]}",
                endpoint="/v1/chat/completions", completion_window="24h",
                metadata={"run": str(i)}, tenant=tenant)
            at = str(batch.created_at + 60)
            failed = i % 10 == 0
            await client.hset(keys.batch(batch.id), mapping={
                "total": 100, "completed": 100 - failed * 3, "failed": failed * 3})
            await batch_move(keys, batch.id, allowed=("validating",), status="completed",
                             fields={"in_progress_at": str(batch.created_at + 1),
                                     "finalizing_at": at, "completed_at": at,
                                     "output_file_id": orjson.dumps(f"file-out{i}").decode(),
                                     "error_file_id": orjson.dumps(
                                         f"file-err{i}" if failed else None).decode()}
                             ).run_async(client)
            await client.srem(keys.active_batches, batch.id)
            await client.srem(keys.tenant_open_batches(tenant), batch.id)
    finally:
        await client.aclose()


class _At:
    """A pipeline whose XADDs take the id of a moment in the past: the samples
    the heartbeats wrote over the window, written at once (the console reads a
    sample's time from its entry id)."""

    def __init__(self, pipe: Any, at: float) -> None:
        self.pipe, self.ms = pipe, int(at * 1000)

    def xadd(self, name: str, fields: dict[str, Any], **options: Any) -> Any:
        return self.pipe.xadd(name, fields, id=f"{self.ms}-*", **options)


def fill_fleet(r: redis.Redis, keys: Keys) -> None:
    """The queue declared, its streams' groups (every tenant's), and ``WORKERS``
    live workers: their heartbeat hashes, places in the served set, and 15
    minutes of samples, all on Redis's clock. Written last: the window ends now."""
    seconds, micros = r.time()
    now = seconds + micros / 1e6
    declare(r, keys, QUEUE, 1, now)
    r.sadd(keys.tenants(QUEUE), *TENANTS)
    for priority in PRIORITIES:
        for tenant in (None, *TENANTS):
            r.xgroup_create(level_stream(keys, QUEUE, priority, tenant), GROUP, id="0",
                            mkstream=True)
    alive_until = now + 86_400  # far off: no worker lapses during the run
    pipe = r.pipeline(transaction=False)
    for n in range(WORKERS):
        name = f"w{n}@bench"
        stats = {"steps": 90_000, "prefill_steps": 9_000, "tokens": 1_600_000,
                 "jobs": {"succeeded": 25_000}, "peak_batch": 64, "last_batch": 48,
                 "busy_s": 850.0, "failed_steps": 0, "store_retries": 0, "preempted": 0,
                 "tokens_per_s": 1800.0 + n, "rate_window_s": 10.0, "started_at": now - 3600}
        pipe.hset(keys.worker(name), mapping={
            "name": name, "host": "bench-host", "pid": 1000 + n, "queue": QUEUE,
            "model": "tiny", "device": "cuda", "chat": 1, "fim": 0, "tools": "",
            "max_batch": 64, "prefetch": 8, "running": 48, "waiting": 3, "draining": 0,
            "fatal": "", "failing": "", "stats": orjson.dumps(stats), "last_seen": repr(now),
            "alive_until": repr(alive_until)})
        pipe.expire(keys.worker(name), 86_400)
        pipe.zadd(keys.queue_workers(QUEUE), {name: alive_until})
    pipe.execute()
    every, samples = fleet_history.HISTORY_EVERY_S, int(fleet_history.HISTORY_S
                                                        // fleet_history.HISTORY_EVERY_S)
    pipe = r.pipeline(transaction=False)
    for k in range(samples):  # oldest first: entry ids only grow
        at = now - (samples - 1 - k) * every
        for n in range(WORKERS):
            fleet_history.add(_At(pipe, at), keys, worker=f"w{n}@bench", queue=QUEUE,
                              tokens_per_s=1800.0 + 50 * (k % 7), running=48, waiting=3,
                              backlog_tokens=4000 + 100 * k, now=at)
    pipe.execute()


def forget(r: redis.Redis, keys: Keys) -> None:
    """Delete the namespace's keys (a Redis given with --redis-url keeps the rest)."""
    batch: list[bytes] = []
    for key in r.scan_iter(match=f"{keys.namespace}:*", count=1000):
        batch.append(key)
        if len(batch) == 1000:
            r.unlink(*batch)
            batch = []
    if batch:
        r.unlink(*batch)


def check(page: str, kind: str, answer: httpx.Response) -> None:
    """A page that failed fast is no figure: each must show what was filled."""
    if answer.status_code != 200:
        raise SystemExit(f"{page} page ({kind}) answered {answer.status_code}: "
                         f"{answer.text[:300]}")
    if kind == "json":
        body = answer.json()
        shown = len(body["workers"]) if page == "fleet" else len(body["batches"])
    else:
        shown = answer.text.count('<tr class="worker' if page == "fleet" else '<tr class="batch"')
    wanted = WORKERS if page == "fleet" else ROWS
    if shown != wanted:
        raise SystemExit(f"{page} page ({kind}) shows {shown} rows, not {wanted}")
    if page == "fleet" and kind == "json" and not any(
            point["tokens_per_s"] for point in body["history"]):
        raise SystemExit("fleet page (json): the 15 minutes' lines hold no sample")


def commands(r: redis.Redis) -> dict[str, int]:
    """Redis's count of calls of each command so far (``INFO commandstats``)."""
    return {name.removeprefix("cmdstat_"): int(v["calls"])
            for name, v in r.info("commandstats").items()}


def time_page(http: httpx.Client, r: redis.Redis, page: str, path: str, kind: str,
              requests: int) -> dict[str, Any]:
    """p50 / p95 / max in ms of ``requests`` loads after the warm-ups, and the
    Redis commands a load made (the gateway's background loops' included: a
    driver's poll, the webhook deliverer's; SCAN and KEYS are counted apart,
    the reads whose cost grows with the keyspace)."""
    took = []
    for i in range(WARM_UPS + requests):
        if i == WARM_UPS:
            before = commands(r)
        start = time.perf_counter()
        answer = http.get(path, headers={"Accept": ACCEPT[kind]})
        ms = (time.perf_counter() - start) * 1000
        check(page, kind, answer)
        if i >= WARM_UPS:
            took.append(ms)
    after = commands(r)
    made = {name: n - before.get(name, 0) for name, n in after.items()}
    made["info"] -= 1  # the reading itself
    ordered = sorted(took)
    return {"p50": statistics.median(ordered),
            "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
            "max": ordered[-1], "calls": sum(made.values()) / requests,
            "scans": sum(made.get(name, 0) for name in ("scan", "keys")) / requests}


def one_size(url: str, jobs: int, requests: int) -> tuple[int, dict[tuple[str, str], Any]]:
    """Fill a fresh namespace with ``jobs`` finished jobs, time the pages, clear it."""
    namespace = f"console-bench-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    r = redis.Redis.from_url(url)
    try:
        start = time.perf_counter()
        seconds, micros = r.time()
        fill_jobs(r, keys, jobs, seconds + micros / 1e6)
        asyncio.run(fill_batches(url, keys, BATCHES))
        fill_fleet(r, keys)
        size = r.dbsize()
        print(f"{jobs} finished jobs: filled in {time.perf_counter() - start:.1f} s, "
              f"DBSIZE {size}", flush=True)
        files = tempfile.TemporaryDirectory(prefix="console-bench-")
        settings = Settings(redis_url=url, namespace=namespace, gateway_auth="off",
                            files_url=f"file://{files.name}")
        port = free_port()
        server = uvicorn.Server(server_config(settings, host="127.0.0.1", port=port,
                                              log_level="warning"))
        thread = threading.Thread(target=server.run, name="gateway", daemon=True)
        thread.start()
        try:
            wait_for(lambda: server.started or not thread.is_alive(), 60, "the gateway to start")
            if not server.started:
                raise SystemExit("the gateway did not start (its log is above)")
            results = {}
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                for page, path in PAGES:
                    for kind in ACCEPT:
                        f = results[(page, kind)] = time_page(http, r, page, path, kind,
                                                              requests)
                        print(f"  {page:5} {kind:4}  p50 {f['p50']:6.1f} ms  p95 {f['p95']:6.1f} ms"
                              f"  max {f['max']:6.1f} ms  Redis calls/load {f['calls']:5.1f}"
                              f" (SCAN or KEYS {f['scans']:.1f})", flush=True)
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            files.cleanup()
        return size, results
    finally:
        forget(r, keys)
        r.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000,
                        help="finished jobs of the large run (the small one has 1,000)")
    parser.add_argument("--redis-url", default=None,
                        help="a Redis to use (a namespace of its own; deleted after); "
                             "default: a redis-server of the run's own")
    parser.add_argument("--requests", type=int, default=30, help="timed loads per page")
    args = parser.parse_args()
    server = None if args.redis_url else RedisProc()
    url = args.redis_url if server is None else server.url
    sizes = sorted({1000, args.jobs})
    runs = {}
    try:
        for jobs in sizes:
            runs[jobs] = one_size(url, jobs, args.requests)
    finally:
        if server is not None:
            server.close()
    print("\nms per load (p50 / p95 / max), one request at a time; Redis calls per load:")
    print(f"{'page':12}" + "".join(f"{f'{n} jobs, DBSIZE {runs[n][0]}':>40}" for n in sizes))
    for page, _path in PAGES:
        for kind in ACCEPT:
            cells = []
            for n in sizes:
                f = runs[n][1][(page, kind)]
                cells.append(f"{f['p50']:.1f} / {f['p95']:.1f} / {f['max']:.1f} ms,"
                             f" {f['calls']:.1f} calls")
            print(f"{page + ' ' + kind:12}" + "".join(f"{c:>40}" for c in cells))
    print()
    largest = sizes[-1]
    for page, _path in PAGES:
        for kind in ACCEPT:
            f = runs[largest][1][(page, kind)]
            print(f"{page} page ({kind}), {largest} finished jobs: p50 {f['p50']:.1f} ms, "
                  f"p95 {f['p95']:.1f} ms (target < {TARGET_MS:.0f} ms)")


if __name__ == "__main__":
    main()
