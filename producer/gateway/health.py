"""The gateway's probes: ``GET /healthz`` (live) and ``GET /readyz`` (ready);
``GET /health`` and ``GET /version``, the routes vLLM's server has that benchmark
tools probe (guidellm asks ``/health`` before a run).

- **live**: the process's event loop answers a request. Redis is not asked: a
  Redis outage is not cured by restarting every gateway (each restart would
  only cut the event streams it serves), so a liveness probe must not fail on it.
- **ready**: the gateway can take a request now: Redis answers a PING within
  ``HEALTH_TIMEOUT_S`` through the gateway's own connection pool (so a pool
  whose every connection is busy past that reads as not ready, and a load
  balancer sends the next request to another gateway), and the gateway is not
  shutting down. uvicorn serves nothing before the app's startup (its first
  PING) has run, so a gateway still starting is not ready either.

- ``/health`` is ``/healthz`` under vLLM's name (the same function, the same answer).
- ``/version``: ``{"version": ...}``, tokenfleet's version, as vLLM answers its own.

All are free of ``Authorization``: a kubelet, a load balancer or a benchmark's
probe has no key. A probe answers 200 or 503 with a small JSON body; ``ok``
says which, ``why`` why not.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import socket
from typing import Any

import uvicorn
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from tokenfleet.shared.wire.errors import RedisBusy

# A probe must answer fast: the client's own retries (riding out a Redis
# restart) would otherwise keep it waiting for many seconds.
HEALTH_TIMEOUT_S = 2.0

router = APIRouter()


def _version() -> str:
    try:
        return importlib.metadata.version("tokenfleet")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


VERSION = _version()


@router.get("/health")  # vLLM's name for it
@router.get("/healthz")
async def healthz() -> Response:
    return JSONResponse({"ok": True})


@router.get("/version")
async def version() -> Response:
    return JSONResponse({"version": VERSION})


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    if getattr(request.app.state, "shutting_down", False):
        return _not_ready("shutting down: finishing the requests in progress")
    client = request.app.state.fleet
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            await client.redis.ping()
    except RedisBusy as exc:
        return _not_ready(str(exc))
    except TimeoutError:
        if _pool_full(client.redis):
            return _not_ready("every Redis connection of this gateway is in use: "
                              "TOKENFLEET_GATEWAY_REDIS_CONNECTIONS")
        return _not_ready(f"Redis does not answer PING within {HEALTH_TIMEOUT_S:g}s")
    except (RedisError, OSError):
        return _not_ready("Redis does not answer PING")
    return JSONResponse({"ok": True})


def _pool_full(redis: Any) -> bool:
    """Whether the client's pool has no connection to give (one server's pool;
    a Cluster client's pools are per node: not judged)."""
    pool = getattr(redis, "connection_pool", None)
    return pool is not None and not pool.can_get_connection()


def _not_ready(why: str) -> Response:
    return JSONResponse({"ok": False, "why": why}, status_code=503)


class GatewayServer(uvicorn.Server):
    """uvicorn, telling the app when its shutdown starts: from then on
    ``/readyz`` answers 503 to a request still reaching it on an open
    connection (new connections are refused once the listener closes)."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        app: Any = self.config.app
        if hasattr(app, "state"):
            app.state.shutting_down = True
        await super().shutdown(sockets)
