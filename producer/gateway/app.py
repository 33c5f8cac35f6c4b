"""An HTTP gateway for web backends: the fleet's API over FastAPI.

``serve(host, port)`` (or ``tokenfleet gateway``) serves

- ``POST /v1/jobs``, ``GET /v1/jobs/{id}``, ``DELETE /v1/jobs/{id}``: submit, read, cancel;
- ``GET /v1/jobs/{id}/events``: the job's tokens as Server-Sent Events, resumable with
  ``Last-Event-ID``;
- OpenAI-compatible ``POST /v1/completions`` (``tokenfleet.gateway.completions``),
  ``POST /v1/chat/completions`` (``tokenfleet.gateway.chat``), ``GET /v1/models`` and
  ``GET /v1/models/{id}`` (the queues live workers serve, and the declared ones);
- OpenAI's Responses API, ``/v1/responses`` (``tokenfleet.gateway.responses``): stored,
  resumable from any gateway, and in the background;
- OpenAI's Files API, ``/v1/files`` (``tokenfleet.gateway.files``);
- OpenAI-compatible ``/v1/batches`` (``tokenfleet.gateway.batches``), whose
  lines every gateway's batch driver runs;
- ``GET /healthz`` (live) and ``GET /readyz`` (ready), and vLLM's ``GET /health`` (the
  same as ``/healthz``) and ``GET /version``: ``tokenfleet.gateway.health``;
- ``GET /metrics``: the gateway's Prometheus metrics (``tokenfleet.gateway.metrics``);
- ``/console``: the fleet, its jobs, batches and dead letters in a browser
  (``tokenfleet.gateway.console``), behind the same keys.

Any other path is a 404 in OpenAI's shape, code ``unknown_url`` (``POST /v1/embeddings``
included: OpenAI's clients and benchmark tools read it as OpenAI's own), and a path
served with another method a 405 in the same shape.

Every route but health, ``/version`` and ``/metrics`` asks for an API key (on a loopback address,
once one was ever made: ``tokenfleet.gateway.auth``); a key's tenant owns the jobs made with
it, and another tenant's ids read as missing (``tokenfleet.shared.wire.ownership``);
its limits apply where a job is submitted (``tokenfleet.gateway.key_limits``).

Event streams send a keep-alive comment every ``sse_keepalive_s`` while nothing
else goes out; the server bounds the time a client takes to send a request's head
(``header_timeout_s``) and body (``body_timeout_s``): see ``tokenfleet.gateway.timeouts``.
One ``AsyncFleetClient`` per app, opened in the lifespan and closed at shutdown.
Every refusal, with its status and whether a client should retry, is one of
``tokenfleet.openai.errors`` (docs/errors.md lists them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast
from urllib.parse import quote

import orjson
import uvicorn
from fastapi import APIRouter, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.exception_handlers import http_exception_handler
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from tokenfleet.gateway.error_response import error_response
from tokenfleet.gateway import batches as openai_batches
from tokenfleet.gateway import chat as openai_chat
from tokenfleet.gateway import completions as openai_compat
from tokenfleet.gateway import files as openai_files
from tokenfleet.gateway import sse
from tokenfleet.gateway.job_events import job_event_frames
from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.client.sync import FleetClient
from tokenfleet.gateway.console import routes as console_routes
from tokenfleet.gateway.console.pages import wants_json
from tokenfleet.gateway.auth import (CONSOLE, Authenticate, announce, auth_mode, caller,
                                     is_console, unauthorized, warn_while_open)
from tokenfleet.gateway.health import HEALTH_TIMEOUT_S, GatewayServer
from tokenfleet.gateway.metrics import GatewayMetrics, MeasureRequests
from tokenfleet.gateway.health import router as health_router
from tokenfleet.gateway.key_limits import KeyLimits, submit_as_caller
from tokenfleet.gateway.request_body import (BodyTooLarge, fleet, keepalive_s, openai_body,
                                             read_body)
from tokenfleet.gateway import responses as openai_responses
from tokenfleet.openai.errors import (
    BODY_TIMEOUT,
    METHOD_NOT_ALLOWED,
    MODEL_NOT_FOUND,
    REDIS_BUSY,
    REDIS_DOWN,
    UNKNOWN_URL,
    Refusal,
    fleet_refusal,
)
from tokenfleet.client.served import listed, listed_queues, served, served_queues
from tokenfleet.shared.wire.api_keys import KeyBook
from tokenfleet.shared.compat.uvicorn_h11 import MAX_HEAD_BYTES
from tokenfleet.shared.wire.errors import (
    JobNotFound,
    RedisAuthFailed,
    RedisBusy,
    RedisUnavailable,
    TokenfleetError,
)
from tokenfleet.shared.wire.ownership import owns
from tokenfleet.shared.redis.pool import PoolBound
from tokenfleet.shared.wire.schemas import GenerationRequest, JobState
from tokenfleet.shared.settings import Settings, get_settings
from tokenfleet.gateway.tenant_refusals import CountRefusals, note
from tokenfleet.gateway.timeouts import BodyDeadline, BodyTimeout, head_deadline_protocol
from tokenfleet.webhooks.delivery import Deliverer

log = logging.getLogger("tokenfleet.gateway.app")

router = APIRouter()


def json_response(state: JobState, status_code: int = 200) -> Response:
    return Response(state.model_dump_json(), status_code=status_code,
                    media_type="application/json")


def validation_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors, JSON-safe, located in the body as FastAPI does; the
    input is left out (it can be a whole prompt)."""
    errors: list[dict[str, Any]] = orjson.loads(exc.json(include_url=False, include_input=False))
    for error in errors:
        error["loc"] = ["body", *error["loc"]]
    return errors


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway app; ``settings`` defaults to the process-wide ones. An app
    served by ``server_config`` runs the auth mode of its address; one made
    here with the mode unset (a test's in-process client) runs ``auto``."""
    settings = settings or get_settings()
    mode = settings.gateway_auth or "auto"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One pool for every route: submits, reads and the event streams' pub/sub.
        bound = PoolBound(settings.gateway_redis_connections, settings.gateway_redis_wait_s)
        app.state.fleet = AsyncFleetClient(settings=settings, bound=bound)
        # Reach Redis once before serving: a client that has never connected
        # takes a failed connect for a wrong URL and does not retry it, and the
        # first connects of a spike that meets a cold gateway can time out
        # while its event loop parses the spike's requests. Redis down now is
        # no reason not to serve: the first request that reaches it counts.
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                await app.state.fleet.redis.ping()
        app.state.keybook = KeyBook(app.state.fleet.redis, app.state.fleet.keys,
                                    settings.gateway_key_cache_s)
        app.state.limits = KeyLimits(app.state.fleet, tenant_by_body=mode == "off")
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                await announce(mode, app.state.keybook)
        except (RedisError, OSError, TimeoutError):
            log.warning("could not read the API keys (Redis does not answer): each request "
                        "reads them again (TOKENFLEET_GATEWAY_AUTH=%s)", mode)
        warning = (asyncio.create_task(warn_while_open(app.state.keybook)) if mode == "auto"
                   else None)
        webhooks = app.state.webhooks = Deliverer(
            app.state.fleet.redis, app.state.fleet.keys, settings).start(settings.gateway_webhooks)
        app.state.finishers = openai_responses.Finishers(app.state.fleet)
        # The console's fleet view reuses ``tokenfleet status``'s reads, which
        # are synchronous: they run in a thread, on a client of their own.
        app.state.console_reads = FleetClient(settings=settings)
        try:
            async with openai_batches.driving(app):
                yield
        finally:
            if warning is not None:
                warning.cancel()
            await app.state.finishers.close()
            await webhooks.stop()
            await app.state.limits.close()
            await app.state.fleet.close()
            app.state.console_reads.close()

    app = FastAPI(title="tokenfleet gateway", lifespan=lifespan)
    app.include_router(router)
    app.include_router(openai_files.router)
    app.include_router(openai_batches.router)
    app.include_router(openai_responses.router)
    app.include_router(health_router)
    app.include_router(console_routes.router)
    app.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)
    app.add_middleware(CountRefusals)  # inside Authenticate: it reads the key it set
    app.add_middleware(
        Authenticate, mode=mode,
        error=_refuse_unknown_key,
        peek=lambda scope, key: scope["app"].state.limits.peek(scope, key),
        failed=_handled)
    # Outermost: every answer is counted, a 401 too; /metrics needs no key.
    app.add_middleware(MeasureRequests, metrics=GatewayMetrics(app.state))
    app.add_exception_handler(RedisConnectionError, _redis_unreachable)
    # Redis is up, the pool is full: these classes are more specific than the
    # ConnectionError above, so their handler is the one used.
    app.add_exception_handler(RedisBusy, _redis_busy)
    app.add_exception_handler(MaxConnectionsError, _redis_busy)
    app.add_exception_handler(RedisTimeoutError, _redis_unreachable)
    app.add_exception_handler(TokenfleetError, _fleet_error)
    # Both are TokenfleetErrors too, but mean Redis, not the request (a gateway
    # started while Redis is down meets RedisUnavailable on its first request).
    app.add_exception_handler(RedisUnavailable, _redis_unreachable)
    app.add_exception_handler(RedisAuthFailed, _fleet_error)
    app.add_exception_handler(BodyTimeout, _body_timeout)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    return app


def server_config(settings: Settings | None = None, *, host: str = "127.0.0.1",
                  port: int = 8000, **uvicorn_options: Any) -> uvicorn.Config:
    """uvicorn's configuration for the gateway, its time limits included.

    The h11 protocol is set, not chosen: the limits on a request's head live in
    it (``tokenfleet.gateway.timeouts``): its time, and its size (``MAX_HEAD_BYTES``,
    16 KiB: a 431 past it). uvicorn closes a keep-alive connection idle for 5 s.
    The auth mode left unset is the one for ``host`` (``auth_mode``).
    """
    settings = settings or get_settings()
    settings = settings.model_copy(update={"gateway_auth": auth_mode(settings.gateway_auth, host)})
    return uvicorn.Config(create_app(settings), host=host, port=port, lifespan="on",
                          http=head_deadline_protocol(settings.header_timeout_s),
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, **uvicorn_options)


def serve(host: str = "127.0.0.1", port: int = 8000, *, settings: Settings | None = None,
          header_timeout_s: float | None = None, body_timeout_s: float | None = None,
          sse_keepalive_s: float | None = None, auth: str | None = None,
          ssl_keyfile: str | None = None, ssl_certfile: str | None = None) -> None:
    """Serve the gateway until interrupted; a limit left None keeps the settings'
    value. ``auth`` overrides ``TOKENFLEET_GATEWAY_AUTH``; with ``ssl_keyfile``
    and ``ssl_certfile`` (PEM) it serves HTTPS only."""
    settings = settings or get_settings()
    given = {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
             "sse_keepalive_s": sse_keepalive_s, "gateway_auth": auth}
    overrides = {name: value for name, value in given.items() if value is not None}
    if overrides:
        settings = Settings.model_validate({**settings.model_dump(), **overrides})
    GatewayServer(server_config(settings, host=host, port=port, ssl_keyfile=ssl_keyfile,
                                ssl_certfile=ssl_certfile)).run()


async def _handled(scope: Any, exc: Exception) -> Response:
    """The app's handler's answer to ``exc`` (raised outside the routes: the
    keys' middleware), found as Starlette finds it: by the class's MRO."""
    handlers = scope["app"].exception_handlers
    for cls in type(exc).__mro__:
        if cls in handlers:
            return cast(Response, await handlers[cls](Request(scope), exc))
    raise exc


def _refuse_unknown_key(scope: Scope, message: str) -> Response:
    """The 401 of a request without a usable key; a browser opening the
    console is sent to its sign-in page instead."""
    request = Request(scope)
    if is_console(scope["path"]) and not wants_json(request):
        return RedirectResponse(f"{CONSOLE}/login", status_code=303)
    return unauthorized(_openai_path(scope["path"]), message)


def _openai_path(path: str) -> bool:
    """Every route but the jobs API (the gateway's own) is OpenAI's, and answers in its shape."""
    return not (path == "/v1/jobs" or path.startswith("/v1/jobs/"))


def _error(request: Request, refusal: Refusal, message: str, *, param: str | None = None,
           headers: dict[str, str] | None = None) -> Response:
    """An error in the shape the endpoint's clients expect: OpenAI's or FastAPI's."""
    note(request.state, refusal)  # the reason a tenant's refusal is counted under
    if _openai_path(request.url.path):
        return error_response(refusal.error(message, param=param, headers=headers))
    return JSONResponse({"detail": message}, status_code=refusal.status,
                        headers={**refusal.headers(), **(headers or {})})


async def _redis_unreachable(request: Request, exc: Exception) -> Response:
    return _error(request, REDIS_DOWN, REDIS_DOWN.sentence)


async def _redis_busy(request: Request, exc: Exception) -> Response:
    message = str(exc) if isinstance(exc, RedisBusy) else (
        "the fleet is busy: every Redis connection of this gateway is in use; retry later, "
        "or raise TOKENFLEET_GATEWAY_REDIS_CONNECTIONS")
    return _error(request, REDIS_BUSY, message)


async def _fleet_error(request: Request, exc: Exception) -> Response:
    refusal, message, param = fleet_refusal(exc, request.url.path)
    if refusal is MODEL_NOT_FOUND:
        return await _model_not_found(request, getattr(exc, "queue", "?"),
                                      getattr(exc, "served", None))
    # A rate limit's own Retry-After: when the same request would pass.
    return _error(request, refusal, message, param=param, headers=getattr(exc, "headers", None))


async def _model_not_found(request: Request, model: str, served_now: list[str] | None
                           ) -> Response:
    """404: no live worker serves the model's queue. Said to an API caller, who
    cannot start a worker or queue ahead of one: the models served now instead."""
    if served_now is None:  # an older NoWorker: look them up
        served_now = []
        with contextlib.suppress(RedisError, OSError):
            served_now = [s.queue for s in await served_queues(fleet(request))]
    names = ", ".join(repr(q) for q in served_now) or "none"
    return _error(request, MODEL_NOT_FOUND,
                  f"the model {model!r} does not exist or no live worker serves it (served "
                  f"now: {names}): GET /v1/models lists those served", param="model")


async def _http_error(request: Request, exc: Exception) -> Response:
    """The router's own 404 (no route has the path) and 405 (none takes the
    method) in OpenAI's shape; a route's ``HTTPException`` (the jobs API's 404
    for an id) as FastAPI answers it."""
    assert isinstance(exc, StarletteHTTPException)
    method, path = request.method, request.scope.get("path", "")
    route = request.scope.get("route")
    if exc.status_code == 404 and route is None:
        return error_response(UNKNOWN_URL.error(
            f"Invalid URL ({method} {path}): this gateway does not serve it (it serves "
            "/v1/completions, /v1/chat/completions, /v1/models, /v1/files, /v1/batches and "
            "/v1/jobs)"))
    methods = getattr(route, "methods", None)
    if exc.status_code == 405 and methods is not None and method not in methods:
        # Every route of the path, not only the first the router met (/v1/files: GET and POST).
        allowed = sorted({m for r in request.app.routes
                          if r.matches(request.scope)[0] is not Match.NONE
                          for m in getattr(r, "methods", None) or ()} or methods)
        allow = ", ".join(allowed)
        return error_response(METHOD_NOT_ALLOWED.error(
            f"Invalid method ({method} {path}): this gateway does not serve {method} on "
            f"{path} (allowed: {allow})", headers={**(exc.headers or {}), "Allow": allow}))
    return await http_exception_handler(request, exc)


async def _body_timeout(request: Request, exc: Exception) -> Response:
    # The rest of the body may still be on its way: the connection cannot be reused.
    return _error(request, BODY_TIMEOUT, str(exc), headers={"Connection": "close"})


@router.post("/v1/jobs", status_code=202)
async def submit_job(request: Request) -> Response:
    client = fleet(request)
    try:
        body = await read_body(request, client.settings.max_payload_bytes)
    except BodyTooLarge as exc:
        raise HTTPException(413, str(exc)) from exc
    try:
        job = GenerationRequest.model_validate_json(body, context={"settings": client.settings})
    except ValidationError as exc:
        return JSONResponse({"detail": validation_errors(exc)}, status_code=422)
    if job.messages is not None:
        queue = await served(client, job.model)
        if queue is not None and queue.chat is False:
            raise HTTPException(400, f"model {job.model!r} has no chat template, so it cannot "
                                "take messages: send a prompt instead")
    job_id, = await submit_as_caller(request, client, [job])
    return JSONResponse({"id": job_id, "status": "queued"}, status_code=202,
                        headers={"Location": f"/v1/jobs/{quote(job_id, safe=':')}"})


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: Request) -> Response:
    return json_response(await _state(request, job_id))


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
    if caller(request.state) is not None:  # without a key, every job is the caller's
        await _state(request, job_id)  # another tenant's job: 404, nothing cancelled
    try:
        done = await fleet(request).cancel(job_id)
    except JobNotFound as exc:
        raise HTTPException(404, str(exc)) from exc
    return {"id": job_id, "cancelled": done}


@router.get("/v1/jobs/{job_id}/events")
async def job_events(
    job_id: str, request: Request, last_event_id: str | None = Header(default=None)
) -> StreamingResponse:
    """``event: token`` per token event (one token or several; ``id:`` the index
    of its last token), then ``event: end`` with the final job state.
    ``Last-Event-ID: n`` resumes after the token of index ``n``."""
    client = fleet(request)
    await _state(request, job_id)  # 404 now, before the stream has started
    after = -1
    if last_event_id:
        try:
            after = int(last_event_id)
        except ValueError as exc:
            raise HTTPException(
                400, f"Last-Event-ID must be a token index as sent in 'id:', not {last_event_id!r}"
            ) from exc
    return sse.response(job_event_frames(client, job_id, after, request.scope),
                        keepalive_s(request))


async def _state(request: Request, job_id: str) -> JobState:
    """The job's state, or a 404: no such job, or another tenant's (told the same)."""
    try:
        state = await fleet(request).status(job_id)
    except JobNotFound as exc:
        raise HTTPException(404, str(exc)) from exc
    key = caller(request.state)
    if key is not None and not owns(key.tenant, state):
        raise HTTPException(404, str(JobNotFound(job_id)))
    return state


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = await openai_body(request)
    if isinstance(body, Response):
        return body
    return await openai_compat.complete(fleet(request), body, request, keepalive_s(request))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = await openai_body(request)
    if isinstance(body, Response):
        return body
    return await openai_chat.chat(fleet(request), body, request, keepalive_s(request))


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The queues live workers serve, and the declared ones (their pool may be
    scaled to zero), as OpenAI lists models."""
    return {"object": "list", "data": [s.as_openai() for s in await listed_queues(fleet(request))]}


@router.get("/v1/models/{model}")
async def get_model(model: str, request: Request) -> Response:
    found = await listed(fleet(request), model)
    if found is None:
        return await _model_not_found(request, model, None)
    return JSONResponse(found.as_openai())
