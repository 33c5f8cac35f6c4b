"""One line of a batch: from its input JSON to a job, and from the job's end to
its line in the output or error file.

A line's body goes through the same checks as the single request to its
endpoint (``openai_compat.completion``, ``openai_chat.chat_request``), so a
line the endpoint would refuse is refused as it refuses the request: the
line's ``response`` carries the route's status and its whole error body, as
OpenAI's error file does (``error`` is set only where no request was made: a
line that is not JSON, has no custom_id or is a duplicate, names another url,
or expired or was cancelled before its end). Its answer is built as the
endpoint builds it (``completion_answer``, ``chat_answer``). A line runs as a
job of priority ``batch`` under an idempotency key naming the batch and the
line: fed again after a crash, it names the same job, and nothing is
generated twice.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.openai.answer import failed, failure
from tokenfleet.openai.chat import Chat, chat_answer, chat_request
from tokenfleet.openai.completions import Completion, completion, completion_answer
from tokenfleet.openai.errors import UNSUPPORTED, OpenAIError, Refusal, fleet_refusal
from tokenfleet.openai.translate import to_body
from tokenfleet.shared.wire.errors import (InvalidRequest, QueueNotAllowed, TokenfleetError,
                                           invalid_input)
from tokenfleet.shared.file_store import Overlong
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.keys import named_tenant
from tokenfleet.shared.wire.schemas import GenerationRequest, JobState, JobStatus


@dataclass(frozen=True)
class LineError:
    """Why a line has no result: OpenAI's error code (or type) and the message."""

    code: str
    message: str


@dataclass(frozen=True)
class RefusedLine(LineError):
    """A request the endpoint refused, or whose job failed: the single route's
    HTTP status and error body, written as the line's ``response``."""

    status: int = 400
    body: dict[str, Any] = field(default_factory=dict)
    request_id: str | None = None  # the job's id, where one was made


def refusal(row: Refusal, message: str, *, param: str | None = None,
            request_id: str | None = None) -> RefusedLine:
    """The refusal ``row`` with ``message``, as the single route answers it."""
    return RefusedLine(row.code or row.type, message, status=row.status,
                       body=row.body(message, param=param), request_id=request_id)


@dataclass(frozen=True)
class Parsed:
    """A line's JSON, checked for what every batch line needs."""

    custom_id: str | None
    body: dict[str, Any] | LineError


@dataclass(frozen=True)
class Ready:
    """A line checked as its endpoint checks a request: the job to run, and what
    its answer is built from."""

    made: Completion | Chat
    job: GenerationRequest


def parse(raw: bytes, endpoint: str, settings: Settings | None = None) -> Parsed:
    """The line's custom_id and body, or the error that says what is missing.
    ``settings``: the limits a line written as the fleet's request is read
    against (the driver's client's, as its endpoint checks the body after)."""
    if isinstance(raw, Overlong):
        return Parsed(None, LineError(
            "line_too_long", f"the line is {raw.size} bytes, over the {raw.limit} a batch line "
            "may hold (a request's TOKENFLEET_MAX_PAYLOAD_BYTES and 64 KiB for its custom_id, "
            "method and url): send a shorter request"))
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Parsed(None, LineError("invalid_json", f"the line is not valid JSON ({exc})"))
    if not isinstance(line, dict):
        return Parsed(None, LineError("invalid_request", "a line must be a JSON object with "
                                      "custom_id, method, url and body"))
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Parsed(None, LineError("missing_custom_id",
                                      "the line has no custom_id (a non-empty string)"))
    if line.get("method", "POST") != "POST":
        return Parsed(custom_id, LineError("invalid_method", "method must be POST"))
    if line.get("url") != endpoint:
        return Parsed(custom_id, LineError(
            "invalid_url", f"url must be the batch's endpoint {endpoint!r}, got "
            f"{str(line.get('url'))[:80]!r}"))
    if "request" in line and "body" not in line:
        return Parsed(custom_id, _body_of(line["request"], settings))
    body = line.get("body")
    if not isinstance(body, dict):
        return Parsed(custom_id, LineError("invalid_request",
                                           "body must be the request's JSON object"))
    return Parsed(custom_id, body)


def _body_of(request: Any, settings: Settings | None) -> dict[str, Any] | LineError:
    """The endpoint's body of a line written as the fleet's request itself
    (``client.submit_batch`` of ``GenerationRequest``s), or why it has none."""
    try:
        return to_body(GenerationRequest.model_validate(request, context={"settings": settings}))
    except ValidationError as exc:
        return LineError("invalid_request", f"request: {invalid_input(exc)}")
    except InvalidRequest as exc:
        return LineError("invalid_request", str(exc))


def refused(error: OpenAIError) -> RefusedLine:
    """A single request's refusal: its status and body, as the line's response."""
    return RefusedLine(error.code, error.message, status=error.status, body=error.body)


def fleet_error(exc: TokenfleetError, endpoint: str) -> RefusedLine:
    """A refusal at submit (a limit of the queue's workers, say), as the gateway
    answers it to a single request to ``endpoint``."""
    row, message, param = fleet_refusal(exc, endpoint)
    return refusal(row, message, param=param)


async def ready(client: AsyncFleetClient, body: dict[str, Any], *, endpoint: str,
                batch_id: str, index: int, tenant: str, queues: list[str] | None
                ) -> Ready | LineError:
    """The job of a line's body, or the error its endpoint would answer."""
    if body.get("stream"):
        return refusal(UNSUPPORTED, "stream is not supported by this gateway in a batch: a "
                       "line's result is written whole; leave it unset", param="stream")
    raw = orjson.dumps(body)
    made = await (completion(client, raw) if endpoint == "/v1/completions"
                  else chat_request(client, raw))
    if isinstance(made, OpenAIError):
        return refused(made)
    if made.n != 1:
        return refusal(UNSUPPORTED, "n is not supported by this gateway in a batch above 1: "
                       "send one line per choice", param="n")
    if queues is not None and made.job.model not in queues:
        return fleet_error(QueueNotAllowed(made.job.model, queues), endpoint)
    job = made.job.model_copy(update={
        "priority": "batch", "tenant": named_tenant(tenant),
        "idempotency_key": job_key(batch_id, index)})
    return Ready(made, job)


def job_key(batch_id: str, index: int) -> str:
    """The idempotency key of a line's job: the same job every time it is fed."""
    return f"batch:{batch_id}:{index}"


async def answer(client: AsyncFleetClient, made: Completion | Chat, job_id: str,
                 state: JobState) -> dict[str, Any]:
    """The body the endpoint answers for the line's succeeded job."""
    if isinstance(made, Completion):
        return await completion_answer(client, made, [job_id], [state])
    return await chat_answer(client, made, [job_id], [state])


def job_error(state: JobState) -> LineError:
    """Why a line's ended job has no result."""
    if state.status is JobStatus.CANCELLED:
        return LineError("batch_cancelled", "the batch was cancelled before this request "
                         "finished")
    if state.status is JobStatus.EXPIRED:
        return expired()
    return refusal(failed(state), failure(state), request_id=state.id)


def expired() -> LineError:
    return LineError("batch_expired", "this request could not be executed before the "
                     "batch's completion window expired")


def request_id() -> str:
    return f"batch_req_{secrets.token_hex(12)}"


def output_line(custom_id: str | None, job_id: str, body: dict[str, Any]) -> bytes:
    return orjson.dumps({"id": request_id(), "custom_id": custom_id,
                         "response": {"status_code": 200, "request_id": job_id, "body": body},
                         "error": None})


def error_line(custom_id: str | None, error: LineError) -> bytes:
    """The line in the error file: a refused request's response, or the error
    of a line that made none."""
    if isinstance(error, RefusedLine):
        response = {"status_code": error.status,
                    "request_id": error.request_id or f"req_{secrets.token_hex(12)}",
                    "body": error.body}
        return orjson.dumps({"id": request_id(), "custom_id": custom_id,
                             "response": response, "error": None})
    return orjson.dumps({"id": request_id(), "custom_id": custom_id, "response": None,
                         "error": {"code": error.code, "message": error.message}})
