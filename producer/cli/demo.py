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

from rich import box
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
        # Fair share off on the embedded fakeredis: its Lua runs no XREADGROUP
        # (fair.lua's read), and the demo has one tenant anyway.
        settings = Settings(redis_url=url, namespace="tokenfleet-demo", block_ms=50,
                            require_worker=False, fair_share=redis_url is not None)
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
    job_ids = [client.submit(p, model=client.settings.queue, max_new_tokens=max_new_tokens,
                             temperature=temperature, require_worker=False)
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
    # The tiny model writes a job's tokens in a fraction of a second. On a
    # terminal the text is revealed at reading speed, as a chat window does, so
    # the stream can be seen; the timings printed after it are the fleet's own.
    pace = READING_CHARS_PER_S if console.is_terminal else None
    shown = dict.fromkeys(job_ids, 0)
    started = time.monotonic()
    with Live(console=console, refresh_per_second=FPS, transient=True) as live:
        while True:
            elapsed = time.monotonic() - started
            for j in job_ids:
                shown[j] = len(texts[j]) if pace is None else min(len(texts[j]), int(elapsed * pace))
            revealed = {j: texts[j][:shown[j]] for j in job_ids}
            finished = {j for j in done if shown[j] >= len(texts[j])}
            live.update(_table(prompts, job_ids, revealed, finished, console.width))
            if len(finished) == len(job_ids) or (not any(t.is_alive() for t in threads) and \
                    len(done) < len(job_ids)):
                break
            time.sleep(1 / FPS)  # the screen's refresh rate, not synchronisation
    for t in threads:
        t.join(timeout=5)
    states = [client.status(j) for j in job_ids]
    timings = {s.id: f"[dim]{len(s.token_ids)} tokens, first {_ms(s.created_at, s.first_token_at)}"
                     f", last {_ms(s.created_at, s.finished_at)}[/dim]" for s in states}
    console.print(_table(prompts, job_ids, texts, done, console.width, timings=timings))
    return {p: s.text for p, s in zip(prompts, states)}


FPS = 12
READING_CHARS_PER_S = 120


def _ms(start: float | None, end: float | None) -> str:
    return "-" if start is None or end is None else f"{(end - start) * 1000:.0f} ms"


def _table(prompts: list[str], job_ids: list[str], texts: dict[str, str], done: set[str],
           width: int, timings: dict[str, str] | None = None) -> Table:
    """One line per job while streaming (the newest text, so it fits an 80x24
    terminal); at the end the whole text, and the fleet's timings of each job."""
    full = timings is not None
    table = Table(title="tokenfleet demo: tokens streaming from the fleet", box=box.SIMPLE,
                  expand=True, show_header=False, pad_edge=False)
    table.add_column("prompt", style="bold cyan", width=min(24, width // 4), no_wrap=not full)
    table.add_column("generated", ratio=1, no_wrap=not full)
    table.add_column("", width=1)
    room = max(10, width - min(24, width // 4) - 8)
    for prompt, job_id in zip(prompts, job_ids):
        text = texts[job_id].replace("\n", " ")
        label = f"{prompt}\n{timings[job_id]}" if timings else prompt
        table.add_row(label, text if full else text[-room:], "✓" if job_id in done else "…")
    return table
