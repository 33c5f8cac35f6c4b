"""API keys at the gateway's door: who is calling, before any route runs.

``Authenticate`` is a plain ASGI middleware (no per-request task or body copy):
it reads ``Authorization: Bearer <key>``, looks the key up (``KeyBook``: Redis,
kept under a second), and either answers 401 itself or hands the request on
with the key's record in ``request.state.api_key``. Health probes pass without
a key. On the way out it adds the key's ``x-ratelimit-*`` headers, which the
route (or, for a route that counts nothing, this middleware) put in
``request.state.rate_headers``.

``TOKENFLEET_GATEWAY_AUTH``: ``auto`` asks for a key once any key exists (a
fresh install keeps working locally; a key made later holds at once), ``on``
always, ``off`` never. The key is never logged: only its id is ever named.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.openai_errors import INVALID_API_KEY
from tokenfleet.shared.api_keys import KeyBook
from tokenfleet.shared.schemas import ApiKey

log = logging.getLogger("tokenfleet.gateway")

# Probes answer without a key: an orchestrator has none.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
MISSING = ("missing API key: send the header 'Authorization: Bearer <key>' "
           "(`tokenfleet keys create --tenant NAME` makes one)")
INCORRECT = ("incorrect API key provided: it does not exist or was revoked "
             "(`tokenfleet keys list` shows the keys in force)")


def bearer(headers: Headers) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def caller(state: Any) -> ApiKey | None:
    """The key a request came with (``request.state``), None on an open gateway."""
    key: ApiKey | None = getattr(state, "api_key", None)
    return key


async def announce(mode: str, book: KeyBook) -> None:
    """Say at start, loudly, whether this gateway asks for keys."""
    if mode == "off":
        log.warning("API keys are off (TOKENFLEET_GATEWAY_AUTH=off / --no-auth): anyone who "
                    "reaches this gateway can submit, read and cancel any job; serve it on a "
                    "private network only")
    elif mode == "auto" and not await book.any_exist():
        log.warning("no API key exists: this gateway serves everyone without a key until the "
                    "first is made (tokenfleet keys create --tenant NAME); set "
                    "TOKENFLEET_GATEWAY_AUTH=on to refuse requests without a key now")
    else:
        log.info("API keys are required (Authorization: Bearer) on every route but health")


# What the app gives the middleware (see ``Authenticate.__init__``).
ErrorFor = Callable[[Scope, str], Response]
Peek = Callable[[Scope, ApiKey], Awaitable[None] | None]
Failed = Callable[[Scope, Exception], Awaitable[Response]]


class Authenticate:
    """The ASGI middleware described above; the app's ``KeyBook`` (made in its
    lifespan, with its Redis client) is ``app.state.keybook``."""

    def __init__(self, app: ASGIApp, *, mode: str, error: ErrorFor, peek: Peek,
                 failed: Failed) -> None:
        # ``error(scope, message)``: the 401 in the path's error shape;
        # ``peek(scope, key)``: the read of the rate headers of a route that
        # counts nothing (None for one that counts: it sets them itself);
        # ``failed(scope, exc)``: the app's answer to an error reading the keys
        # (Redis down: a 503), which its exception handlers, inside this
        # middleware, never see.
        self.app, self.mode, self.error, self.peek, self.failed = app, mode, error, peek, failed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or self.mode == "off" or scope["path"] in OPEN_PATHS):
            await self.app(scope, receive, send)
            return
        try:
            refused = await self._authenticate(scope)
        except Exception as exc:
            refused = await self.failed(scope, exc)
        if refused is not None:
            await refused(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                peeking = state.pop("peeking", None)
                if peeking is not None:
                    try:
                        await peeking
                    except (RedisError, OSError, TimeoutError) as exc:
                        # The response goes out without the key's headers.
                        log.info("the rate limits of key %s were not read: %s", key_id,
                                 type(exc).__name__)
                extra = state.get("rate_headers")
                if extra:
                    message = {**message, "headers": [
                        *message.get("headers", []),
                        *((k.encode(), v.encode()) for k, v in extra.items())]}
            await send(message)

        key_id = state["api_key"].key_id if "api_key" in state else "-"
        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            if "peeking" in state:  # no response started (the client left)
                state.pop("peeking").cancel()

    async def _authenticate(self, scope: Scope) -> Response | None:
        """None to go on (``state.api_key`` set where a key was read), or the refusal."""
        book: KeyBook = scope["app"].state.keybook
        if self.mode == "auto" and not await book.any_exist():
            # Open until the first key is made; a key sent anyway is not read
            # (OpenAI's client always sends one, whatever it is set to).
            return None
        presented = bearer(Headers(scope=scope))
        if presented is None:
            return self.error(scope, MISSING)
        key = await book.lookup(presented)
        if key is None:
            return self.error(scope, INCORRECT)
        state = scope.setdefault("state", {})
        state["api_key"] = key
        reading = self.peek(scope, key) if key.limited else None
        if reading is not None:
            # Read while the route runs: its headers are wanted only when the
            # response starts, so the read adds no round trip of its own.
            state["peeking"] = asyncio.ensure_future(reading)
        return None


def unauthorized(openai_shape: bool, message: str) -> JSONResponse:
    """401 with ``WWW-Authenticate``, in OpenAI's shape or the jobs API's."""
    headers = {"WWW-Authenticate": "Bearer"}
    if openai_shape:
        return INVALID_API_KEY.response(message, headers=headers)
    return JSONResponse({"detail": message}, status_code=401,
                        headers={**INVALID_API_KEY.headers(), **headers})
