"""API keys at the gateway's door: who is calling, before any route runs.

``Authenticate`` is a plain ASGI middleware (no per-request task or body copy):
it reads ``Authorization: Bearer <key>``, looks the key up (``KeyBook``: Redis,
kept under a second), and either answers 401 itself or hands the request on
with the key's record in ``request.state.api_key``. Health probes pass without
a key. On the way out it adds the key's ``x-ratelimit-*`` headers, which the
route (or, for a route that counts nothing, this middleware) put in
``request.state.rate_headers``.

``TOKENFLEET_GATEWAY_AUTH``: ``on`` always asks for a key, ``off`` never,
``auto`` once a key has ever been made on the fleet (a fresh install keeps
working locally; a key made later holds at once; revoking every key, or Redis
losing its data while the gateway runs, does not open it again). Unset, a
gateway bound to a loopback address runs ``auto`` and any other ``on``
(``auth_mode``). ``auto`` says so in a WARNING at start, and every minute
while it serves without keys. The key is never logged: only its id is named.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError
from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.gateway.error_response import error_response
from tokenfleet.openai.errors import INVALID_API_KEY
from tokenfleet.shared.wire.api_keys import KeyBook
from tokenfleet.shared.wire.schemas import ApiKey

log = logging.getLogger("tokenfleet.gateway.app")

# Probes answer without a key: an orchestrator has none (nor a benchmark
# tool asking vLLM's /health and /version before its run).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health", "/version"})
# The console is opened in a browser, which sends no Authorization header: the
# sign-in its page makes comes back in this cookie (HttpOnly,
# SameSite=Strict: no other site's page can make the browser send it; a token,
# not the key: ``api_keys.open_sign_in``), read on the console's own paths
# only, so no API route can be driven by a cookie.
CONSOLE = "/console"
CONSOLE_COOKIE = "tokenfleet_console"
# What the console serves to anyone: its sign-in page and its own assets.
CONSOLE_OPEN = ("/console/login", "/console/static/")
MISSING = ("missing API key: send the header 'Authorization: Bearer <key>' "
           "(`tokenfleet keys create --tenant NAME` makes one)")
SIGNED_OUT = "signed out: the console's sign-in ended or its key was revoked; sign in again"
INCORRECT = ("incorrect API key provided: it does not exist or was revoked "
             "(`tokenfleet keys list` shows the keys in force)")


# How often an open ``auto`` gateway repeats that it serves everyone.
OPEN_WARNING_S = 60.0
OPEN = ("no API key was ever made on this fleet: this gateway (TOKENFLEET_GATEWAY_AUTH=auto) "
        "serves everyone without a key until the first is made (tokenfleet keys create "
        "--tenant NAME); set TOKENFLEET_GATEWAY_AUTH=on to refuse requests without a key now")


def auth_mode(setting: str | None, host: str) -> str:
    """The mode of a gateway bound to ``host``: the setting, or when it is unset
    ``on`` for every address but loopback (a gateway others can reach never
    starts open), ``auto`` on loopback (a local try-out)."""
    if setting is not None:
        return setting
    return "auto" if _loopback(host) else "on"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def bearer(headers: Headers) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def is_console(path: str) -> bool:
    return path == CONSOLE or path.startswith(CONSOLE + "/")


def sign_in_token(scope: Scope, headers: Headers) -> str | None:
    """The console sign-in token a request on a console path presents, or None."""
    if not is_console(scope["path"]):
        return None
    return cookie_parser(headers.get("cookie", "")).get(CONSOLE_COOKIE) or None


def _open_path(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(CONSOLE_OPEN)


def caller(state: Any) -> ApiKey | None:
    """The key a request came with (``request.state``), None on an open gateway."""
    key: ApiKey | None = getattr(state, "api_key", None)
    return key


def caller_tenant(state: Any) -> str | None:
    """The tenant of the key a request came with, None on an open gateway."""
    key = caller(state)
    return None if key is None else key.tenant


async def announce(mode: str, book: KeyBook) -> None:
    """Say at start, loudly, whether this gateway asks for keys."""
    if mode == "off":
        log.warning("API keys are off (TOKENFLEET_GATEWAY_AUTH=off / --no-auth): anyone who "
                    "reaches this gateway can submit, read and cancel any job; serve it on a "
                    "private network only")
    elif mode == "auto" and not await book.ever_made():
        log.warning(OPEN)
    elif mode == "auto":
        # Closed now, but only as long as Redis keeps the mark that keys were made.
        log.warning("API keys are required (keys were made on this fleet), but "
                    "TOKENFLEET_GATEWAY_AUTH=auto: if Redis loses its data, this gateway "
                    "serves everyone from its next start; set TOKENFLEET_GATEWAY_AUTH=on")
    else:
        log.info("API keys are required (Authorization: Bearer) on every route but health")


async def warn_while_open(book: KeyBook, every_s: float = OPEN_WARNING_S) -> None:
    """An ``auto`` gateway's task: the WARNING ``OPEN`` every ``every_s`` while
    no key was ever made; it ends once one is (the gateway never opens again)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            if await book.ever_made():
                return
        except (RedisError, OSError, TimeoutError):
            continue  # each request reads the keys again, and is refused meanwhile
        log.warning(OPEN)


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
        if scope["type"] != "http" or self.mode == "off" or _open_path(scope["path"]):
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
        if self.mode == "auto" and not await book.ever_made():
            # Open until the first key is made; a key sent anyway is not read
            # (OpenAI's client always sends one, whatever it is set to).
            return None
        headers = Headers(scope=scope)
        presented = bearer(headers)
        token = sign_in_token(scope, headers) if presented is None else None
        if presented is None and token is None:
            return self.error(scope, MISSING)
        key = (await book.lookup(presented) if presented is not None
               else await book.signed_in(str(token)))
        if key is None:
            return self.error(scope, INCORRECT if presented is not None else SIGNED_OUT)
        state = scope.setdefault("state", {})
        state["api_key"] = key
        noting = book.note_use(key)
        if noting is not None:  # its last use, once a minute: the request does not wait
            _in_background(noting)
        reading = self.peek(scope, key) if key.limited else None
        if reading is not None:
            # Read while the route runs: its headers are wanted only when the
            # response starts, so the read adds no round trip of its own.
            state["peeking"] = asyncio.ensure_future(reading)
        return None


# The writes no request waits for, kept until done (a task nobody holds may
# be collected before it ends).
_background: set[asyncio.Future[Any]] = set()


def _in_background(work: Awaitable[Any]) -> None:
    task = asyncio.ensure_future(work)
    _background.add(task)
    task.add_done_callback(_settled)


def _settled(task: asyncio.Future[Any]) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.info("a key's last use was not written: %s", type(task.exception()).__name__)


def unauthorized(openai_shape: bool, message: str) -> JSONResponse:
    """401 with ``WWW-Authenticate``, in OpenAI's shape or the jobs API's."""
    headers = {"WWW-Authenticate": "Bearer"}
    if openai_shape:
        return error_response(INVALID_API_KEY.error(message, headers=headers))
    return JSONResponse({"detail": message}, status_code=401,
                        headers={**INVALID_API_KEY.headers(), **headers})
