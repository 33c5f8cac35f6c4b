"""What API keys cost at the gateway: the time a key's checks (lookup, rate
limits, ownership) add to a request.

Two gateways serve one namespace of one Redis, one with keys off, one asking
for a key: each a process of its own (``tokenfleet gateway``) as deployed, or
with ``--in-process`` threads of the bench's process, where the HTTP client
and both servers share one interpreter lock. Requests alternate between four sides on
keep-alive connections (no key on the first gateway; on the second a key
without limits, a key with rpm and tpm, and one with rpm, tpm and
max_queued, all set too high to refuse), so all see the same load and drift;
the difference of their medians is the checks' cost.
Two routes: ``POST /v1/jobs`` (a submit: lookup, ``rate_take.lua`` counting
the request and its tokens) and ``GET /v1/jobs/{id}`` (a read: lookup, the
limits' headers, ownership). Then the checks alone, without HTTP. The jobs
go to a queue a pretend worker "serves" and never reads; the namespace is
deleted at the end.

    python -m tokenfleet.bench.key_checks --requests 2000
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click
import httpx
import redis
import uvicorn

from tokenfleet.gateway.app import server_config
from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.redis.connect import connect
from tokenfleet.shared.wire.schemas import ApiKey
from tokenfleet.shared.settings import Settings, get_settings

QUEUE = "keybench"


@contextmanager
def _gateway_process(settings: Settings) -> Iterator[httpx.Client]:
    """``tokenfleet gateway`` on a free port, with the bench's settings."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "TOKENFLEET_NAMESPACE": settings.namespace,
           "TOKENFLEET_REDIS_URL": settings.redis_url,
           "TOKENFLEET_GATEWAY_AUTH": settings.gateway_auth or "auto",
           "TOKENFLEET_MAX_QUEUE": str(settings.max_queue)}
    command = [sys.executable, "-c", "from tokenfleet.cli.app import main; main()",
               "gateway", "--host", "127.0.0.1", "--port", str(port)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as http:
            deadline = time.monotonic() + 60
            while True:  # another process: nothing to wait on but its port
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/healthz").status_code == 200:
                        break
                if process.poll() is not None or time.monotonic() > deadline:
                    raise click.ClickException(f"the gateway on port {port} did not start")
                time.sleep(0.05)
            yield http
    finally:
        process.terminate()
        process.wait(20)


@contextmanager
def _gateway(settings: Settings) -> Iterator[httpx.Client]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(settings, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}") as http:
        yield http
    server.should_exit = True
    thread.join(20)


def _timed(call: Callable[[], httpx.Response]) -> float:
    start = time.perf_counter()
    response = call()
    elapsed = time.perf_counter() - start
    if response.status_code >= 300:
        raise click.ClickException(f"{response.status_code}: {response.text}")
    return elapsed * 1000


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def _row(name: str, off: list[float], on: list[float]) -> str:
    p50_off, p50_on = statistics.median(off), statistics.median(on)
    return (f"{name:<26} off p50 {p50_off:6.3f} ms p99 {_p99(off):6.3f} | key p50 {p50_on:6.3f} "
            f"ms p99 {_p99(on):6.3f} | added p50 {p50_on - p50_off:+.3f} ms")


async def _components(settings: Settings, key: str, record: ApiKey, n: int) -> list[str]:
    """The checks' own work, timed alone on one asyncio client: a cached key
    lookup, one ``rate_take.lua`` (what a keyed request adds), a PING beside it."""
    from tokenfleet.shared.wire.api_keys import KeyBook
    from tokenfleet.shared.wire.gateway_scripts import rate_take
    from tokenfleet.shared.redis.connect import connect_async

    client = connect_async(settings.redis_url)
    keys = Keys(settings.namespace)
    book = KeyBook(client, keys, settings.gateway_key_cache_s)
    await book.lookup(key)

    async def ping() -> None:
        await client.ping()

    async def lookup() -> None:
        await book.lookup(key)

    async def take() -> None:
        await rate_take(keys, key_id=record.key_id, request_id=uuid.uuid4().hex,
                        now=time.time(), rpm=record.rpm, tpm=record.tpm, requests=1,
                        tokens=20).run_async(client)

    rows = []
    for name, call in (("PING (a round trip)", ping), ("key lookup (cached)", lookup),
                       ("rate_take.lua", take)):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            await call()
            times.append((time.perf_counter() - start) * 1000)
        rows.append(f"{name:<26} p50 {statistics.median(times):6.3f} ms p99 {_p99(times):6.3f}")
    await client.aclose()
    return rows


@click.command()
@click.option("--requests", default=2000, show_default=True, help="requests per route and side")
@click.option("--redis-url", default=None, help="Redis URL (default: $TOKENFLEET_REDIS_URL)")
@click.option("--in-process", is_flag=True,
              help="serve the gateways on threads of this process, not processes of their own")
def main(requests: int, redis_url: str | None, in_process: bool) -> None:
    base = get_settings()
    settings = base.model_copy(update={"namespace": f"keybench{uuid.uuid4().hex[:8]}",
                                       "redis_url": redis_url or base.redis_url,
                                       "max_queue": 4 * (requests + 50) + 10})
    r: redis.Redis = connect(settings.redis_url)
    keys = Keys(settings.namespace)
    r.zadd(keys.queue_workers(QUEUE), {"pretend@bench": time.time() + 3600})
    plain_key, plain_id = new_key()
    create_key(r, keys, ApiKey(key_id=plain_id, tenant="bench", created_at=time.time()), plain_key)
    key, key_id = new_key()
    record = ApiKey(key_id=key_id, tenant="bench", rpm=10**9, tpm=10**12, created_at=time.time())
    create_key(r, keys, record, key)
    capped_key, capped_id = new_key()
    create_key(r, keys, record.model_copy(update={"key_id": capped_id,
                                                  "max_queued": 10**9}), capped_key)
    body = {"prompt": "a prompt of a few words", "model": QUEUE,
            "sampling": {"max_new_tokens": 16}}
    try:
        serve = _gateway if in_process else _gateway_process
        with (serve(settings.model_copy(update={"gateway_auth": "off"})) as off,
              serve(settings.model_copy(update={"gateway_auth": "on"})) as on):
            sides: tuple[tuple[str, httpx.Client, dict[str, str]], ...] = (
                ("off", off, {}), ("key", on, {"Authorization": f"Bearer {plain_key}"}),
                ("limited", on, {"Authorization": f"Bearer {key}"}),
                ("capped", on, {"Authorization": f"Bearer {capped_key}"}))
            for _, http, headers in sides:  # warm: connections, scripts, cache
                for _ in range(50):
                    http.post("/v1/jobs", json=body, headers=headers)
            posts: dict[str, list[float]] = {side: [] for side, _, _ in sides}
            ids: dict[str, list[str]] = {side: [] for side, _, _ in sides}
            for _ in range(requests):
                for side, http, headers in sides:
                    start = time.perf_counter()
                    response = http.post("/v1/jobs", json=body, headers=headers)
                    posts[side].append((time.perf_counter() - start) * 1000)
                    ids[side].append(response.json()["id"])
            gets: dict[str, list[float]] = {side: [] for side, _, _ in sides}
            for i in range(requests):
                for side, http, headers in sides:
                    gets[side].append(_timed(lambda: http.get(f"/v1/jobs/{ids[side][i]}",
                                                              headers=headers)))
        where = "threads of this process" if in_process else "processes of their own"
        click.echo(f"{requests} requests per route and side, alternating: no key (keys off), "
                   "a key without limits, a key with rpm and tpm, one with max_queued too; "
                   f"gateways: {where}")
        for route, times in (("POST /v1/jobs", posts), ("GET /v1/jobs/{id}", gets)):
            click.echo(_row(f"{route}, key", times["off"], times["key"]))
            click.echo(_row(f"{route}, limits", times["off"], times["limited"]))
        click.echo(_row("POST /v1/jobs, +max_queued", posts["off"], posts["capped"]))
        click.echo("the checks alone (no HTTP), same Redis:")
        for line in asyncio.run(_components(settings, key, record, requests)):
            click.echo(line)
    finally:
        names = list(r.scan_iter(match=f"{settings.namespace}:*", count=1000))
        for name in names:
            r.delete(name)
        r.close()


if __name__ == "__main__":
    main()
