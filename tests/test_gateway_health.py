"""The gateway's readiness once its shutdown starts: uvicorn closes its listener
(a probe's new connection is refused) and ``/readyz`` answers 503 to a request
still arriving on an open connection."""

from __future__ import annotations

import asyncio
import socket

import httpx
import uvicorn

from tokenfleet.gateway.app import create_app
from tokenfleet.gateway.health import GatewayServer
from tokenfleet.shared.settings import Settings


def dead_redis_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there


def test_readyz_is_503_once_the_shutdown_started_and_healthz_stays_200() -> None:
    app = create_app(Settings(redis_url=dead_redis_url()))
    app.state.shutting_down = True

    async def ask() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return await http.get("/readyz"), await http.get("/healthz")

    ready, live = asyncio.run(ask())
    assert ready.status_code == 503 and ready.json()["why"].startswith("shutting down")
    assert live.status_code == 200


def test_the_gateway_server_marks_the_app_as_shutting_down_when_it_stops() -> None:
    app = create_app(Settings(redis_url=dead_redis_url()))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))

    class StopsOnceUp(GatewayServer):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            self.marked_while_serving = getattr(app.state, "shutting_down", False)
            self.should_exit = True  # what SIGTERM does

    server = StopsOnceUp(uvicorn.Config(app, lifespan="on", log_level="warning"))
    asyncio.run(server.serve(sockets=[sock]))
    assert server.marked_while_serving is False
    assert app.state.shutting_down is True
