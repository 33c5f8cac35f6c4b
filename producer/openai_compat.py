"""OpenAI-compatible ``POST /v1/completions`` on top of the fleet.

``model`` is the queue name. Fields the fleet has no use for (``user``,
``presence_penalty``, ...) are ignored, as OpenAI-style servers do; the ones whose
meaning it cannot honour (``n`` > 1, ``best_of`` > 1, ``echo``, ``logprobs``) are
refused rather than silently answered differently. A client that disconnects
before its completion is done cancels the job, so the worker's slot is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from redis.exceptions import RedisError

from tokenfleet.aio import AsyncFleetClient
from tokenfleet.shared.errors import QueueFull, TokenfleetError
from tokenfleet.shared.schemas import FinishReason, GenerationRequest, JobState, JobStatus

# OpenAI's names for the fields of a GenerationRequest, to name the right ``param``.
PARAMS = {("sampling", "max_new_tokens"): "max_tokens", ("sampling", "temperature"): "temperature",
          ("sampling", "top_p"): "top_p", ("sampling", "stop"): "stop",
          ("sampling", "seed"): "seed", ("prompt",): "prompt", ("model",): "model"}
FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
RETRY_AFTER_S = 1


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = "default"
    prompt: str | list[Any]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    n: int | None = Field(default=1, description="only 1 is supported")
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_text_prompt(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list) and (len(value) != 1 or not isinstance(value[0], str)):
            raise ValueError("prompt must be a string or a list of one string; batched and "
                             "token-id prompts are not supported: send one request per prompt")
        return value

    @field_validator("n", "best_of")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"only one choice per request is supported, got {value}: "
                             "send several requests instead")
        return value

    @field_validator("echo", "logprobs")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value:
            raise ValueError("not supported by this gateway: leave it unset")
        return value

    def generation(self, settings: Any) -> GenerationRequest:
        """The fleet's request for this completion, checked against its limits."""
        sampling: dict[str, Any] = {"max_new_tokens": 16 if self.max_tokens is None
                                    else self.max_tokens}
        for name in ("temperature", "top_p", "seed"):
            if getattr(self, name) is not None:
                sampling[name] = getattr(self, name)
        if self.stop is not None:
            sampling["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return GenerationRequest.model_validate(
            {"prompt": prompt, "model": self.model, "sampling": sampling},
            context={"settings": settings},
        )


def error(status_code: int, message: str, *, param: str | None = None, code: str | None = None,
          type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status_code, headers=headers)


def _invalid(exc: ValidationError, generation: bool) -> Response:
    first = exc.errors(include_url=False)[0]
    loc = tuple(str(part) for part in first["loc"])
    param = PARAMS.get(loc) if generation else (loc[0] if loc else None)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        message = f"the body is not valid JSON ({message})"
    elif param:
        message = f"invalid '{param}': {message}"
    return error(400, message, param=param)


async def complete(client: AsyncFleetClient, body: bytes, request: Request) -> Response:
    try:
        ask = CompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        return _invalid(exc, generation=False)
    try:
        job = ask.generation(client.settings)
    except ValidationError as exc:
        return _invalid(exc, generation=True)
    try:
        job_id = await client.submit(job)
    except QueueFull as exc:
        return error(429, str(exc), type_="requests", code="rate_limit_exceeded",
                     headers={"Retry-After": str(RETRY_AFTER_S)})
    head = {"id": f"cmpl-{job_id}", "object": "text_completion", "created": int(time.time()),
            "model": job.model}
    if ask.stream:
        usage = bool((ask.stream_options or {}).get("include_usage"))
        return StreamingResponse(_chunks(client, job_id, head, usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    state = await _wait_while_connected(client, job_id, request)
    if state is None:
        return Response(status_code=499)  # nobody is left to read it
    if state.status is not JobStatus.SUCCEEDED:
        return error(500, _failure(state), type_="server_error")
    choice = {"index": 0, "text": state.text, "finish_reason": _finish(state), "logprobs": None}
    return JSONResponse({**head, "choices": [choice], "usage": _usage(state)})


async def _chunks(client: AsyncFleetClient, job_id: str, head: dict[str, Any],
                  include_usage: bool) -> AsyncIterator[bytes]:
    ended = False
    try:
        async for event in client.stream(job_id):
            if event.text:
                yield _data({**head, "choices": [_delta(event.text, None)]})
        state = await client.status(job_id)
        ended = True
        if state.status is not JobStatus.SUCCEEDED:
            yield _data({"error": {"message": _failure(state), "type": "server_error",
                                   "param": None, "code": None}})
        else:
            yield _data({**head, "choices": [_delta("", _finish(state))]})
            if include_usage:
                yield _data({**head, "choices": [], "usage": _usage(state)})
        yield b"data: [DONE]\n\n"
    finally:
        if not ended:  # the client went away (or the stream broke): stop the work
            await _cancel_quietly(client, job_id)


async def _wait_while_connected(client: AsyncFleetClient, job_id: str,
                                request: Request) -> JobState | None:
    """The job's final state, or None (and the job cancelled) if the client left first."""
    waiter = asyncio.ensure_future(client.wait(job_id))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        finished = waiter.done()
        if not finished:
            waiter.cancel()
    if finished:
        return waiter.result()
    await _cancel_quietly(client, job_id)
    return None


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_quietly(client: AsyncFleetClient, job_id: str) -> None:
    # Shielded: this runs while the request's task is being cancelled.
    with anyio.CancelScope(shield=True), contextlib.suppress(TokenfleetError, RedisError):
        await client.cancel(job_id)


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _delta(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


def _finish(state: JobState) -> str:
    return FINISH.get(state.finish_reason, "stop") if state.finish_reason else "stop"


def _usage(state: JobState) -> dict[str, int]:
    prompt, completion = state.num_prompt_tokens or 0, len(state.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _failure(state: JobState) -> str:
    reason = state.error or (state.finish_reason.value if state.finish_reason else "no reason")
    return f"the job ended {state.status.value} ({reason}); the completion has no result"
