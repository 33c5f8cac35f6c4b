"""OpenAI-compatible ``POST /v1/completions`` on top of the fleet, and what the
chat endpoint (``tokenfleet.openai_chat``) shares with it.

``model`` is the queue name. Every field of OpenAI's request is either honoured
or refused with a 400 that names it; none is silently ignored. Refused unless
they ask for nothing (the value a client sends by default): ``n`` and
``best_of`` above 1, ``echo``, ``logprobs``, ``suffix``. ``user`` is kept in the
job's metadata. ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``
are honoured as OpenAI defines them, and ``top_k``, ``min_p`` and
``repetition_penalty`` as vLLM takes them. ``response_format`` and vLLM's
``structured_outputs`` constrain the text (``tokenfleet.openai_structured``).
Any other field is refused as unrecognized, as OpenAI does.

A client that disconnects before its completion is done cancels the job, so the
worker's slot is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator
from redis.exceptions import RedisError

from tokenfleet import sse
from tokenfleet.aio import AsyncFleetClient
from tokenfleet.openai_errors import (
    INVALID_JSON,
    INVALID_VALUE,
    JOB_FAILED,
    JOB_REFUSED,
    UNRECOGNIZED,
    UNSUPPORTED,
    Refusal,
)
from tokenfleet.openai_structured import Refused, requested
from tokenfleet.shared.errors import TokenfleetError, invalid_field, invalid_input
from tokenfleet.shared.schemas import (
    REFUSED_BY_WORKER,
    FinishReason,
    FloatNotBool,
    GenerationRequest,
    IntNotBool,
    JobState,
    JobStatus,
)
from tokenfleet.shared.structured import StructuredOutput

# OpenAI's names for the fields of a GenerationRequest, to name the right ``param``.
PARAMS = {("sampling", "max_new_tokens"): "max_tokens", ("sampling", "temperature"): "temperature",
          ("sampling", "top_p"): "top_p", ("sampling", "stop"): "stop",
          ("sampling", "seed"): "seed", ("sampling", "top_k"): "top_k",
          ("sampling", "repetition_penalty"): "repetition_penalty",
          ("sampling", "presence_penalty"): "presence_penalty",
          ("sampling", "frequency_penalty"): "frequency_penalty",
          ("sampling", "logit_bias"): "logit_bias", ("sampling", "min_p"): "min_p",
          ("prompt",): "prompt", ("model",): "model", ("metadata",): "user"}
FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
ONE_CHOICE = "only one choice per request is supported: send one request per choice"

# Fields this gateway cannot honour, with the values that ask for nothing (any
# other is refused with a 400 naming the field), and, where leaving the field
# unset is not the whole advice, the sentence that says what to do instead.
REFUSED: dict[str, tuple[tuple[Any, ...], str | None]] = {
    "n": ((None, 1), "n other than 1 is not supported: " + ONE_CHOICE),
    "best_of": ((None, 1), "best_of other than 1 is not supported: " + ONE_CHOICE),
    "echo": ((None, False), None),
    "logprobs": ((None,), None),
    "suffix": ((None, ""), None),
}


class Sampling(BaseModel):
    """The sampling fields that completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    temperature: FloatNotBool | None = None
    top_p: FloatNotBool | None = None
    top_k: IntNotBool | None = None
    repetition_penalty: FloatNotBool | None = None
    presence_penalty: FloatNotBool | None = None
    frequency_penalty: FloatNotBool | None = None
    min_p: FloatNotBool | None = None
    logit_bias: dict[str, Any] | None = None  # token id (as text, in JSON): bias
    stop: str | list[str] | None = None
    seed: IntNotBool | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # What the text must be, and vLLM's old names for it: openai_structured.py.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("stream_options")
    @classmethod
    def _usage_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = set(value or {}) - {"include_usage"}
        if unknown:
            raise ValueError(f"only include_usage is supported, not {', '.join(sorted(unknown))}")
        return value

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        out: dict[str, Any] = {"max_new_tokens": max_tokens}
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed",
                     "presence_penalty", "frequency_penalty", "min_p", "logit_bias"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return out

    def user_metadata(self) -> dict[str, Any]:
        return {} if self.user is None else {"user": self.user}

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(Sampling):
    prompt: str | list[Any]
    max_tokens: IntNotBool | None = 16
    n: Any = None
    best_of: Any = None
    echo: Any = None
    logprobs: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _one_text_prompt(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list) and (len(value) != 1 or not isinstance(value[0], str)):
            raise ValueError("prompt must be a string or a list of one string; batched and "
                             "token-id prompts are not supported: send one request per prompt")
        return value

    def generation(self, settings: Any, structured: StructuredOutput | None = None
                   ) -> GenerationRequest:
        """The fleet's request for this completion, checked against its limits."""
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return GenerationRequest.model_validate(
            {"prompt": prompt, "model": self.model, "metadata": self.user_metadata(),
             "sampling": self.sampling(16 if self.max_tokens is None else self.max_tokens),
             "structured_output": structured},
            context={"settings": settings},
        )


def invalid(exc: ValidationError, params: dict[tuple[str, ...], str] | None = None) -> Response:
    """A 400 for ``exc`` (:func:`invalid_input`); ``params`` names the fields of a
    GenerationRequest as the client knows them (else the error's location is the
    client's field)."""
    kind = exc.errors(include_url=False)[0]["type"]
    refusal = {"json_invalid": INVALID_JSON, "extra_forbidden": UNRECOGNIZED}.get(kind,
                                                                                 INVALID_VALUE)
    return refusal.response(invalid_input(exc, params), param=invalid_field(exc, params))


def refusal(ask: BaseModel, refused: dict[str, tuple[tuple[Any, ...], str | None]]
            ) -> Response | None:
    """A 400 for the first field set to something this gateway cannot honour. The
    sentence names the field and never echoes its value (it can be a long array)."""
    for name, (nothing, instead) in refused.items():
        value = getattr(ask, name)
        if not any(_same(value, ok) for ok in nothing):
            return UNSUPPORTED.response(instead or unsupported(name, nothing), param=name)
    return None


def unsupported(name: str, nothing: tuple[Any, ...]) -> str:
    """``name`` is not supported: leave it unset (or send one of the values that ask
    for nothing)."""
    values = [orjson.dumps(ok).decode() for ok in nothing if ok is not None]
    return (f"{name} is not supported by this gateway: leave it unset"
            + "".join(f" or {v}" for v in values))


def _same(value: Any, ok: Any) -> bool:
    # 0 == False in Python; in JSON they differ, and here too.
    if isinstance(value, bool) or isinstance(ok, bool):
        return value is ok
    return bool(value == ok)


async def complete(client: AsyncFleetClient, body: bytes, request: Request,
                   keepalive_s: float) -> Response:
    try:
        ask = CompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        return invalid(exc)
    refused = refusal(ask, REFUSED)
    if refused is not None:
        return refused
    try:
        structured, field = requested(ask)
    except Refused as exc:
        return (UNSUPPORTED if exc.unsupported else INVALID_VALUE).response(str(exc),
                                                                           param=exc.param)
    try:
        job = ask.generation(client.settings, structured)
    except ValidationError as exc:
        return invalid(exc, {**PARAMS, ("structured_output",): field or "response_format"})
    job_id = await client.submit(job)  # the app maps the fleet's errors to statuses
    head = {"id": f"cmpl-{job_id}", "object": "text_completion", "created": int(time.time()),
            "model": job.model}
    if ask.stream:
        return sse.response(chunks(client, job_id, head, completion_choice, ask.include_usage),
                            keepalive_s)
    state = await succeeded(client, job_id, request)
    if isinstance(state, Response):
        return state
    choice = completion_choice(state.text, finish(state))
    return JSONResponse({**head, "choices": [choice], "usage": usage(state)})


def completion_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


Choice = Callable[[str, "str | None"], dict[str, Any]]


async def chunks(client: AsyncFleetClient, job_id: str, head: dict[str, Any], choice: Choice,
                 include_usage: bool, opening: dict[str, Any] | None = None
                 ) -> AsyncIterator[bytes]:
    """The job's text as OpenAI stream chunks (``choice`` shapes one): ``opening``
    first, if given; a chunk per piece of text; the finish reason (or an error);
    the usage if asked for; ``[DONE]``."""
    async with cancel_unless_ended(client, job_id) as ended:
        if opening is not None:
            yield data({**head, "choices": [opening]})
        async for events in client.stream_batches(job_id):
            # A backlog goes out as one write: the same chunks, fewer frames.
            frame = b"".join(data({**head, "choices": [choice(e.text, None)]})
                             for e in events if e.text)
            if frame:
                yield frame
        state = await client.status(job_id)
        ended.set()
        if state.status is not JobStatus.SUCCEEDED:
            why = failed(state)
            yield data({"error": {"message": failure(state), "type": why.type,
                                  "param": None, "code": why.code}})
        else:
            yield data({**head, "choices": [choice("", finish(state))]})
            if include_usage:
                yield data({**head, "choices": [], "usage": usage(state)})
        yield b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def cancel_unless_ended(client: AsyncFleetClient, job_id: str) -> AsyncIterator[asyncio.Event]:
    """Cancels the job on exit unless the event was set: the client went away (or
    the stream broke) before the job ended, so its work is of no use."""
    ended = asyncio.Event()
    try:
        yield ended
    finally:
        if not ended.is_set():
            await cancel_quietly(client, job_id)


async def succeeded(client: AsyncFleetClient, job_id: str, request: Request
                    ) -> JobState | Response:
    """The succeeded job's state, or the response that says why there is none:
    499 when the client left first (the job is cancelled), 500 when the job failed."""
    state = await wait_while_connected(client, job_id, request)
    if state is None:
        return Response(status_code=499)  # nobody is left to read it
    if state.status is not JobStatus.SUCCEEDED:
        return failed(state).response(failure(state))
    return state


async def wait_while_connected(client: AsyncFleetClient, job_id: str,
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
    await cancel_quietly(client, job_id)
    return None


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_quietly(client: AsyncFleetClient, job_id: str) -> None:
    # Shielded: this runs while the request's task is being cancelled. Nobody
    # waits for the outcome, so the cancel is asked for and not waited on.
    with anyio.CancelScope(shield=True), contextlib.suppress(TokenfleetError, RedisError):
        await client.cancel(job_id, timeout=0)


def data(obj: dict[str, Any]) -> bytes:
    return sse.event(orjson.dumps(obj))


def finish(state: JobState) -> str:
    return FINISH.get(state.finish_reason, "stop") if state.finish_reason else "stop"


def usage(state: JobState) -> dict[str, int]:
    prompt, completion = state.num_prompt_tokens or 0, len(state.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def failed(state: JobState) -> Refusal:
    """Why the job has no result: the request's fault (its worker refused it) or not."""
    refused = (state.error or "").startswith(REFUSED_BY_WORKER)
    return JOB_REFUSED if refused else JOB_FAILED


def failure(state: JobState) -> str:
    reason = state.error or (state.finish_reason.value if state.finish_reason else "no reason")
    return f"the job ended {state.status.value} ({reason}); the completion has no result"
