"""The HTTP gateway under a real uvicorn on a free port, for integration and fault tests.

Import the ``gateway`` fixture into a test module (``from gateway_server import gateway``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis
import uvicorn

from tokenfleet.gateway.app import server_config
from tokenfleet.shared.wire.keys import Keys


class _Server(uvicorn.Server):
    """uvicorn, telling the test when it listens instead of being polled."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None  # the gateway's, once it listens

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.loop = asyncio.get_running_loop()
        self.ready.set()


async def loop_lateness(done: threading.Event, out: list[float], tick_s: float = 0.01) -> None:
    """How late each wake-up of a ``tick_s`` sleep is, until ``done``: the time
    the event loop it runs on was held by something else."""
    while not done.is_set():
        started = time.monotonic()
        await asyncio.sleep(tick_s)
        out.append(time.monotonic() - started - tick_s)


@pytest.fixture
def gateway(settings: Any) -> Iterator[Callable[..., httpx.Client]]:
    """Start the gateway (with settings overrides) on a free port; returns an HTTP
    client whose ``base_url`` is the gateway."""
    with gateways(settings) as start:
        yield start


@contextlib.contextmanager
def gateways(settings: Any) -> Iterator[Callable[..., httpx.Client]]:
    """What the ``gateway`` fixture gives, for a fixture of any scope: ``start(
    **overrides)`` serves a gateway until the block ends. ``uvicorn_options``
    (a dict) go to uvicorn (TLS files, say); ``scheme`` and ``verify`` to the client;
    ``host`` is the address it binds (the client reaches it on 127.0.0.1)."""
    running: list[tuple[_Server, threading.Thread, httpx.Client]] = []

    def start(*, uvicorn_options: dict[str, Any] | None = None, scheme: str = "http",
              verify: Any = True, host: str = "127.0.0.1", **overrides: Any) -> httpx.Client:
        sock = socket.socket()
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        config = server_config(settings.model_copy(update=overrides), host=host,
                               log_level="warning", **(uvicorn_options or {}))
        server = _Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        assert server.ready.wait(20), "the gateway did not start"
        http = httpx.Client(base_url=f"{scheme}://127.0.0.1:{port}", timeout=60, verify=verify)
        running.append((server, thread, http))
        return http

    try:
        yield start
    finally:
        for server, thread, http in running:
            http.close()
            server.should_exit = True
            thread.join(20)


def port_of(http: httpx.Client) -> int:
    port = http.base_url.port
    assert port is not None
    return port


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, str]]:
    """Parse a text/event-stream into events: {'id', 'event', 'data'} as sent
    (comment lines, such as keep-alives, are skipped)."""
    event: dict[str, str] = {}
    for line in lines:
        if not line:
            if event:
                yield event
            event = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            event[name] = value.removeprefix(" ")


def pin_live_worker(r: redis.Redis, namespace: str, queue: str, name: str = "idle@test",
                    **fields: Any) -> None:
    """Make ``queue`` look served by a live worker that never reads it.

    For tests of what happens while a job waits in its queue: the submit is
    accepted whether or not the client requires a live worker, and nothing runs.
    The heartbeat is dated an hour ahead, so it stays live for the whole test.
    """
    keys = Keys(namespace)
    r.zadd(keys.queue_workers(queue), {name: time.time() + 3600})
    r.hset(keys.worker(name), mapping={"name": name, "queue": queue, "model": "none",
                                       "last_seen": time.time(), **fields})
