"""OpenAI's Responses API on the gateway: ``POST /v1/responses``, ``GET`` and
``DELETE /v1/responses/{id}`` (``?stream=true&starting_after=N`` resumes the
event stream after sequence number N, from any gateway), ``POST
/v1/responses/{id}/cancel`` and ``GET /v1/responses/{id}/input_items``.

The request is checked as a chat (``tokenfleet.openai.responses``), submitted
as the caller's key allows, and stored unless ``store`` is false
(``tokenfleet.openai.stored_responses``). A response not in the background is
the request's: a client that leaves before its end cancels it, as on the chat
route. A background one is answered at once (``queued``) and runs on whatever
happens to the gateway that took it; the gateway waits for its end to store its
final object, and any later read does it where that gateway died first.
Another tenant's response reads as missing (404), as its jobs do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.gateway import sse
from tokenfleet.gateway.answer import cancel_unless_ended
from tokenfleet.gateway.auth import caller, caller_tenant
from tokenfleet.gateway.completions import submit_constrained
from tokenfleet.gateway.error_response import error_response
from tokenfleet.gateway.fanout import cancel_quietly, wait_while_connected
from tokenfleet.gateway.metrics import first_token
from tokenfleet.gateway.request_body import fleet, keepalive_s, openai_body
from tokenfleet.openai.answer import failed, failure
from tokenfleet.openai.chat import chat_request
from tokenfleet.openai.errors import INVALID_VALUE, RESPONSE_NOT_FOUND, OpenAIError
from tokenfleet.openai.responses import InputRefused, chat_body, created, input_items, parse
from tokenfleet.openai.responses import renamed
from tokenfleet.openai.stored_responses import (
    ResponseRecord,
    current,
    delete,
    events,
    finish,
    load,
    pending,
    save,
    sweep,
)
from tokenfleet.shared.wire.errors import JobNotFound
from tokenfleet.shared.wire.schemas import JobStatus

log = logging.getLogger("tokenfleet.gateway.responses")
router = APIRouter()
# How long a cancel waits for a running job to stop (its worker's next step).
CANCEL_WAIT_S = 10.0
MAX_INPUT_ITEMS = 100  # input_items' largest page, as OpenAI's
SWEEP_EVERY_S = 30.0


class Finishers:
    """What stores the final object of background responses: a task per response
    this gateway made, waiting for its job's end; and a sweep, every
    ``SWEEP_EVERY_S``, of those whose gateway died before their end
    (``stored_responses.sweep``). Cancelled at shutdown."""

    def __init__(self, client: AsyncFleetClient) -> None:
        self.client = client
        self.tasks: set[asyncio.Task[None]] = set()
        self._spawn(self._sweep())

    def start(self, record: ResponseRecord) -> None:
        self._spawn(self._finish(record))

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _finish(self, record: ResponseRecord) -> None:
        try:
            await finish(self.client, record, await self.client.wait(record.job_id))
            await self.client.redis.zrem(self.client.keys.responses_pending(), record.id)
        except (RedisError, OSError, JobNotFound) as exc:
            log.warning("background response %s: its final object was not stored (%s); a "
                        "gateway's sweep stores it", record.id, exc)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            try:
                await sweep(self.client)
            except (RedisError, OSError) as exc:
                log.warning("the sweep of background responses failed (%s): again in %.0f s",
                            exc, SWEEP_EVERY_S)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _not_found(response_id: str, param: str | None = None) -> Response:
    return error_response(RESPONSE_NOT_FOUND.error(
        f"no response '{response_id}': never made, not stored, deleted or expired",
        param=param))


async def _record(request: Request, response_id: str) -> ResponseRecord | None:
    return await load(fleet(request), response_id, caller_tenant(request.state),
                      any_tenant=caller(request.state) is None)


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    client = fleet(request)
    body = await openai_body(request)
    if isinstance(body, Response):
        return body
    ask = parse(body)
    if isinstance(ask, OpenAIError):
        return error_response(ask)
    history: list[dict[str, Any]] = []
    if ask.previous_response_id is not None:
        earlier = await _record(request, ask.previous_response_id)
        if earlier is None:
            return _not_found(ask.previous_response_id, "previous_response_id")
        status = (await current(client, earlier))["status"]
        if earlier.final is None or status == "failed":
            return error_response(INVALID_VALUE.error(
                f"previous response '{earlier.id}' is {status}: continue a response once "
                "it has ended with an output", param="previous_response_id"))
        history = earlier.turns()
    try:
        chat = chat_body(ask, history)
    except InputRefused as exc:
        return error_response(INVALID_VALUE.error(str(exc), param="input"))
    made = await chat_request(client, orjson.dumps(chat))
    if isinstance(made, OpenAIError):
        return error_response(renamed(made))
    rid = f"resp_{uuid.uuid4().hex}"
    # A background response's end is posted as OpenAI's response.* event, to the
    # request's webhook_url, else to the fleet's (job_webhook.lua).
    job = made.job.model_copy(update={"response_id": rid}) if ask.background else made.job
    job_ids = await submit_constrained(request, client, [job], 1, made.field)
    if isinstance(job_ids, Response):
        return job_ids
    record = ResponseRecord(
        id=rid, job_id=job_ids[0], tenant=caller_tenant(request.state),
        base=created(rid, ask, made.job, time.time()), chat=chat,
        fmt=made.fmt, input_items=input_items(ask),
        messages=chat["messages"][0 if ask.instructions is None else 1:])
    if ask.stored:
        await save(client, record)
    if ask.background:
        await pending(client, record)
        request.app.state.finishers.start(record)
        if ask.stream:
            return sse.response(_stream(client, record, -1, request.scope, fresh=True),
                                keepalive_s(request))
        return JSONResponse(record.base)
    if ask.stream:
        return sse.response(_foreground(client, record, request.scope), keepalive_s(request))
    states = await wait_while_connected(client, job_ids, request)
    if states is None:
        return Response(status_code=499)  # nobody is left to read it
    state = states[0]
    final = await finish(client, record, state)
    if state.status in (JobStatus.FAILED, JobStatus.EXPIRED):
        return error_response(failed(state).error(failure(state)))
    return JSONResponse(final["response"])


async def _foreground(client: AsyncFleetClient, record: ResponseRecord, scope: Any
                      ) -> AsyncIterator[bytes]:
    """A response streamed to the request that made it: cancelled if its client
    leaves before the end, as a chat's stream is."""
    async with cancel_unless_ended(client, [record.job_id]) as ended:
        async for frame in _stream(client, record, -1, scope, fresh=True):
            yield frame
        ended.set()


async def _stream(client: AsyncFleetClient, record: ResponseRecord, after: int, scope: Any,
                  fresh: bool = False) -> AsyncIterator[bytes]:
    """The response's events after sequence number ``after``, each a Server-Sent
    Event named by its type (``fresh``: the request that made it)."""
    timed = False
    async with contextlib.aclosing(events(client, record, fresh)) as batches:
        async for batch in batches:
            frame = b"".join(sse.event(orjson.dumps(e), name=e["type"])
                             for e in batch if e["sequence_number"] > after)
            if frame:
                if not timed and any(e["type"].endswith(".delta") for e in batch):
                    first_token(scope)
                    timed = True
                yield frame


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, stream: bool = False,
                       starting_after: int = -1) -> Response:
    record = await _record(request, response_id)
    if record is None:
        return _not_found(response_id)
    if stream:
        return sse.response(_stream(fleet(request), record, starting_after, request.scope),
                            keepalive_s(request))
    return JSONResponse(await current(fleet(request), record))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    """Deleted, and its job cancelled if it still runs: nobody can read it now."""
    client = fleet(request)
    record = await _record(request, response_id)
    if record is None:
        return _not_found(response_id)
    if record.final is None:
        await cancel_quietly(client, [record.job_id])
    await delete(client, record)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    """A background response cancelled (one that ended already is answered as
    it ended); OpenAI cancels background responses only."""
    client = fleet(request)
    record = await _record(request, response_id)
    if record is None:
        return _not_found(response_id)
    if not record.base["background"]:
        return error_response(INVALID_VALUE.error(
            "only a background response can be cancelled: a response in the foreground is "
            "cancelled by closing its request", param="response_id"))
    if record.final is None:
        with contextlib.suppress(JobNotFound):
            await client.cancel(record.job_id, timeout=CANCEL_WAIT_S)
    return JSONResponse(await current(client, record))


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, order: str = "desc",
                           limit: int = 20, after: str | None = None) -> Response:
    """The response's own input items (not its predecessors'), with ids, as
    OpenAI's list: newest first unless ``order=asc``."""
    record = await _record(request, response_id)
    if record is None:
        return _not_found(response_id)
    if order not in ("asc", "desc") or not 1 <= limit <= MAX_INPUT_ITEMS:
        return error_response(INVALID_VALUE.error(
            f"order is 'asc' or 'desc' and limit 1 to {MAX_INPUT_ITEMS}",
            param="order" if order not in ("asc", "desc") else "limit"))
    items = [_listed(record, i, item) for i, item in enumerate(record.input_items)]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > limit})


def _listed(record: ResponseRecord, index: int, item: dict[str, Any]) -> dict[str, Any]:
    """An input item as OpenAI lists it: with an id (its own, else one made of
    the response's), a message with its type, status and text parts."""
    out = {"id": f"in_{record.ids}_{index}", **item}
    if out.get("type", "message") == "message":
        content = out.get("content")
        if isinstance(content, str):
            role = out.get("role")
            content = [{"type": "output_text" if role == "assistant" else "input_text",
                        "text": content}]
        out.update(type="message", status=out.get("status", "completed"), content=content)
    return out
