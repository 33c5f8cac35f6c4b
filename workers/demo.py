"""``tokenfleet demo``: the whole path on one machine, no Redis needed.

Starts an in-process fakeredis server on a free TCP port (or uses
``--redis-url``), one worker on the built-in tiny model in this process, submits
a few prompts and streams their tokens side by side as they arrive.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.live import Live
from rich.table import Table

from tokenfleet import FleetClient
from tokenfleet.shared.settings import Settings

PROMPTS = [
    "The function returns",
    "In Python, a list is",
    "This module provides",
    "The default value is",
    "An exception is raised when",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def embedded_redis() -> Iterator[str]:
    """A fakeredis server speaking the Redis protocol on localhost."""
    from fakeredis import TcpFakeServer

    port = free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.shutdown()
        server.server_close()


def run_demo(
    redis_url: str | None,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float,
    console: Console | None = None,
) -> dict[str, str]:
    console = console or Console()
    with embedded_redis() if redis_url is None else _given(redis_url) as url:
        # require_worker=False: the submits may come before the worker's first heartbeat.
        settings = Settings(redis_url=url, namespace="tokenfleet-demo", block_ms=50,
                            require_worker=False)
        from tokenfleet.workers.build import build_worker

        started = time.perf_counter()
        worker = build_worker(settings, name="demo@local")
        worker.start()
        console.print(f"[dim]redis: {'embedded fakeredis' if redis_url is None else url} · "
                      f"model: {settings.model} · worker up in "
                      f"{time.perf_counter() - started:.1f}s[/dim]")
        try:
            with FleetClient(settings=settings) as client:
                return _stream_all(client, prompts, max_new_tokens, temperature, console)
        finally:
            worker.stop(grace_s=5)


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url


def _stream_all(client: FleetClient, prompts: list[str], max_new_tokens: int,
                temperature: float, console: Console) -> dict[str, str]:
    job_ids = [client.submit(p, max_new_tokens=max_new_tokens, temperature=temperature)
               for p in prompts]
    texts = {j: "" for j in job_ids}
    done: set[str] = set()

    def follow(job_id: str) -> None:
        for event in client.stream(job_id, timeout=120):
            texts[job_id] += event.text
        done.add(job_id)

    threads = [threading.Thread(target=follow, args=(j,), daemon=True) for j in job_ids]
    for t in threads:
        t.start()
    with Live(_table(prompts, job_ids, texts, done), console=console, refresh_per_second=12,
              transient=False) as live:
        while len(done) < len(job_ids) and any(t.is_alive() for t in threads):
            time.sleep(1 / 12)  # the screen's refresh rate, not synchronisation
            live.update(_table(prompts, job_ids, texts, done))
        live.update(_table(prompts, job_ids, texts, done))
    for t in threads:
        t.join(timeout=5)
    return {p: client.status(j).text for p, j in zip(prompts, job_ids)}


def _table(prompts: list[str], job_ids: list[str], texts: dict[str, str],
           done: set[str]) -> Table:
    table = Table(title="tokenfleet demo: tokens streaming from the fleet", expand=True)
    table.add_column("prompt", style="bold cyan", ratio=1)
    table.add_column("generated", ratio=4)
    table.add_column("", width=2)
    for prompt, job_id in zip(prompts, job_ids):
        table.add_row(prompt, texts[job_id].replace("\n", " "), "✓" if job_id in done else "…")
    return table
