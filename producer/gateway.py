"""An HTTP gateway for web backends: the fleet's API over FastAPI.

``uvicorn.run(create_app())`` (or ``tokenfleet gateway``) serves

- ``POST /v1/jobs``, ``GET /v1/jobs/{id}``, ``DELETE /v1/jobs/{id}``: submit, read, cancel;
- ``GET /v1/jobs/{id}/events``: the job's tokens as Server-Sent Events, resumable with
  ``Last-Event-ID``;
- ``POST /v1/completions``: OpenAI-compatible completions (``tokenfleet.openai_compat``);
- ``GET /healthz``: whether Redis answers.

One ``AsyncFleetClient`` per app, opened in the lifespan and closed at shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import orjson
from fastapi import APIRouter, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tokenfleet import openai_compat
from tokenfleet.aio import AsyncFleetClient
from tokenfleet.shared.errors import JobNotFound, QueueFull
from tokenfleet.shared.schemas import GenerationRequest, JobState
from tokenfleet.shared.settings import Settings, get_settings

# What a 429 asks a client to wait: queues drain at the fleet's pace, and a client
# that retries at once only adds load.
RETRY_AFTER_S = 1
# A health probe must answer fast: the client's own retries (riding out a Redis
# restart) would otherwise keep it waiting for many seconds.
HEALTH_TIMEOUT_S = 2.0
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

router = APIRouter()


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"request body is larger than this gateway's limit of {limit} bytes "
            "(TOKENFLEET_MAX_PAYLOAD_BYTES): send a shorter prompt or raise the limit"
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused as soon as it passes ``limit`` bytes (before any parsing).

    A declared Content-Length is checked first; a chunked body is counted as it
    arrives, so an oversized one is never held in memory whole.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(limit)
    return bytes(body)


def sse(data: str, *, event: str | None = None, event_id: int | None = None) -> bytes:
    """One Server-Sent Event. ``data`` is compact JSON, so it holds no newline."""
    head = "" if event_id is None else f"id: {event_id}\n"
    head += "" if event is None else f"event: {event}\n"
    return f"{head}data: {data}\n\n".encode()


def fleet(request: Request) -> AsyncFleetClient:
    return cast(AsyncFleetClient, request.app.state.fleet)


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
    """The gateway app; ``settings`` defaults to the process-wide ones."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.fleet = AsyncFleetClient(settings=settings)
        try:
            yield
        finally:
            await app.state.fleet.close()

    app = FastAPI(title="tokenfleet gateway", lifespan=lifespan)
    app.include_router(router)
    app.add_exception_handler(RedisConnectionError, _redis_unreachable)
    app.add_exception_handler(RedisTimeoutError, _redis_unreachable)
    return app


async def _redis_unreachable(request: Request, exc: Exception) -> Response:
    message = "the fleet's Redis cannot be reached right now; retry later"
    if request.url.path == "/v1/completions":
        return openai_compat.error(503, message, type_="server_error")
    return JSONResponse({"detail": message}, status_code=503)


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
    try:
        job_id = await client.submit(job)
    except QueueFull as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
    return JSONResponse({"id": job_id, "status": "queued"}, status_code=202,
                        headers={"Location": f"/v1/jobs/{job_id}"})


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: Request) -> Response:
    return json_response(await _state(fleet(request), job_id))


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
    try:
        done = await fleet(request).cancel(job_id)
    except JobNotFound as exc:
        raise HTTPException(404, str(exc)) from exc
    return {"id": job_id, "cancelled": done}


@router.get("/v1/jobs/{job_id}/events")
async def job_events(
    job_id: str, request: Request, last_event_id: str | None = Header(default=None)
) -> StreamingResponse:
    """``event: token`` per token event (``id:`` its index), then ``event: end``
    with the final job state. ``Last-Event-ID: n`` resumes after index ``n``."""
    client = fleet(request)
    await _state(client, job_id)  # 404 now, before the stream has started
    after = -1
    if last_event_id:
        try:
            after = int(last_event_id)
        except ValueError as exc:
            raise HTTPException(
                400, f"Last-Event-ID must be a token index as sent in 'id:', not {last_event_id!r}"
            ) from exc
    return StreamingResponse(_job_events(client, job_id, after),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _job_events(client: AsyncFleetClient, job_id: str, after: int) -> AsyncIterator[bytes]:
    async for event in client.stream(job_id):
        if event.index > after:
            yield sse(event.model_dump_json(), event="token", event_id=event.index)
    yield sse((await client.status(job_id)).model_dump_json(), event="end")


async def _state(client: AsyncFleetClient, job_id: str) -> JobState:
    try:
        return await client.status(job_id)
    except JobNotFound as exc:
        raise HTTPException(404, str(exc)) from exc


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    client = fleet(request)
    try:
        body = await read_body(request, client.settings.max_payload_bytes)
    except BodyTooLarge as exc:
        return openai_compat.error(413, str(exc))
    return await openai_compat.complete(client, body, request)


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_S):
            await fleet(request).redis.ping()
    except (RedisError, OSError, TimeoutError):
        return JSONResponse({"ok": False, "error": "Redis does not answer PING"}, status_code=503)
    return JSONResponse({"ok": True})
