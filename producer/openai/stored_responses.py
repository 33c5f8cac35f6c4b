"""Stored responses: a response's record in Redis, and its events and final
object made from its job (no HTTP: the routes are ``tokenfleet.gateway.responses``).

A response is a fleet job underneath (priority, fair share, limits, preemption,
crash recovery all apply); its record (``Keys.response``) holds what the job
does not: the request as the chat it became, the input items, the earlier
turns, and, once the job ended, the response's final object, which outlives the
job's record (``TOKENFLEET_RESPONSES_TTL``, 30 days as OpenAI; a job's record
and log keep ``TOKENFLEET_RESULT_TTL_S``). Every gateway reads the same record,
so any of them serves a response another made, and its event stream: the events
are made from the job's token log (``ResponseEvents``), the same at every
replay, so a stream resumes at any sequence number with nothing repeated or lost.

The final object is written by whoever sees the job end first: the gateway that
answers the request, the task a gateway runs for each background response it
made, or any later read. Each makes the same object from the same log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.openai.answer import events as log_events
from tokenfleet.openai.answer import logged
from tokenfleet.openai.chat import ChatRequest, constrained
from tokenfleet.openai.logprobs import chat_logprobs
from tokenfleet.openai.response_events import ResponseEvents, text_logprobs
from tokenfleet.openai.responses import output_messages
from tokenfleet.shared.wire.errors import JobNotFound
from tokenfleet.shared.wire.ownership import tenant_or_default
from tokenfleet.shared.wire.schemas import JobState, JobStatus

# How long after its creation (and between looks) a gateway's sweep looks at a
# background response whose end no gateway stored: its own gateway's finisher
# does, unless that gateway died.
SWEEP_AFTER_S = 60.0


class ResponseRecord(BaseModel):
    id: str
    job_id: str
    tenant: str | None = None
    base: dict[str, Any]  # the response object as created
    chat: dict[str, Any]  # the chat request it became (its tool call, its logprobs)
    fmt: str | None = None  # the queue's tool-call format, with tool_choice "auto"
    input_items: list[dict[str, Any]]
    # The conversation as chat messages up to this response's output: the earlier
    # turns and this input (the instructions apart: they are not carried over).
    messages: list[dict[str, Any]]
    # The response's last event once its job ended: its object is the stored
    # response, its sequence number the stream's last.
    final: dict[str, Any] | None = None

    @property
    def ids(self) -> str:
        """What the response's item ids are made of."""
        return self.id.removeprefix("resp_")

    def turns(self) -> list[dict[str, Any]]:
        """The conversation a next response continues: this one's, with its output."""
        assert self.final is not None
        return [*self.messages, *output_messages(self.final["response"]["output"])]

    def writer(self) -> ResponseEvents:
        ask = ChatRequest.model_validate(self.chat)
        _structured, _field, call = constrained(ask)
        logprobs = text_logprobs(ask.named_shape(chat_logprobs)) if ask.logprobs else None
        return ResponseEvents(self.base, self.ids, call=call, fmt=self.fmt, logprobs=logprobs)


async def save(client: AsyncFleetClient, record: ResponseRecord) -> None:
    """A new record, kept ``responses_ttl`` s."""
    await client.redis.set(client.keys.response(record.id), record.model_dump_json(),
                           ex=client.settings.responses_ttl)


async def load(client: AsyncFleetClient, response_id: str, tenant: str | None,
               any_tenant: bool = False) -> ResponseRecord | None:
    """The record, or None: never made, expired, deleted, or another tenant's
    (told the same: ``tokenfleet.shared.wire.ownership``)."""
    raw = await client.redis.get(client.keys.response(response_id))
    if raw is None:
        return None
    record = ResponseRecord.model_validate_json(raw)
    if not any_tenant and tenant_or_default(tenant) != tenant_or_default(record.tenant):
        return None
    return record


async def delete(client: AsyncFleetClient, record: ResponseRecord) -> None:
    async with client.redis.pipeline(transaction=False) as pipe:
        pipe.delete(client.keys.response(record.id))
        pipe.zrem(client.keys.responses_pending(), record.id)
        await pipe.execute()


async def pending(client: AsyncFleetClient, record: ResponseRecord) -> None:
    """A background response, to be finished by whichever gateway sweeps it first
    (:func:`sweep`) should the one that made it die before its end."""
    await client.redis.zadd(client.keys.responses_pending(),
                            {record.id: time.time() + SWEEP_AFTER_S})


async def sweep(client: AsyncFleetClient, limit: int = 100, now: float | None = None) -> int:
    """Finish the background responses due a look (at ``now``) whose job ended;
    look again later at those still running. Returns how many were finished (or
    gone)."""
    due = await client.redis.zrangebyscore(client.keys.responses_pending(), "-inf",
                                           time.time() if now is None else now,
                                           start=0, num=limit)
    done = 0
    for raw in due:
        rid = raw.decode() if isinstance(raw, bytes) else str(raw)
        record = await load(client, rid, None, any_tenant=True)
        if record is not None and record.final is None:
            try:
                state = await client.status(record.job_id)
            except JobNotFound:
                state = None
            if state is not None and not state.status.is_terminal:
                await pending(client, record)  # still running: look again later
                continue
            await finish(client, record, state)
        await client.redis.zrem(client.keys.responses_pending(), rid)
        done += 1
    return done


async def finish(client: AsyncFleetClient, record: ResponseRecord, state: JobState | None
                 ) -> dict[str, Any]:
    """The final object of a response whose job ended (``state``; None: its job's
    record expired first), stored in its record (its time to live kept) unless it
    was already."""
    if record.final is not None:
        return record.final
    if state is None:
        final = lost(record)
    else:
        log = await logged(client, record.job_id)
        # Off the event loop: a long answer with log probabilities is seconds of Python.
        final = await asyncio.to_thread(_final, record, log, state)
    await store(client, record, final)
    return final


def _final(record: ResponseRecord, log: list[bytes], state: JobState) -> dict[str, Any]:
    writer = record.writer()
    writer.opening()
    try:
        writer.feed(log_events(log))
    except ValueError:
        pass  # a log without the log probabilities asked for: the object says what it can
    final: dict[str, Any] = writer.close(state)[-1]
    return final


def lost(record: ResponseRecord) -> dict[str, Any]:
    """The final event of a response whose job's record expired before anyone
    stored its end (no gateway saw it within ``TOKENFLEET_RESULT_TTL_S``)."""
    opened = 3 if record.base["status"] == "queued" else 2  # the opening's events
    return {"type": "response.failed", "sequence_number": opened, "response": {
        **record.base, "status": "failed", "error": {
            "code": "server_error",
            "message": "the response's job record expired before its end was stored"}}}


async def store(client: AsyncFleetClient, record: ResponseRecord, final: dict[str, Any]
                ) -> None:
    """``final`` (the response's last event) into the record, then into Redis
    (its time to live kept; a deleted record stays deleted). Set in memory only
    once written: a write cut short (its client gone) leaves it to the next."""
    done = record.model_copy(update={"final": final})
    if record.base["store"]:
        await client.redis.set(client.keys.response(record.id), done.model_dump_json(),
                               xx=True, keepttl=True)
    record.final = final


async def current(client: AsyncFleetClient, record: ResponseRecord) -> dict[str, Any]:
    """The response object now: final once its job ended, else its status."""
    if record.final is None:
        try:
            state = await client.status(record.job_id)
        except JobNotFound:
            state = None
        if state is not None and not state.status.is_terminal:
            return {**record.base, "status": "in_progress"
                    if state.status is JobStatus.RUNNING else record.base["status"]}
        await finish(client, record, state)
    assert record.final is not None
    return dict(record.final["response"])


async def events(client: AsyncFleetClient, record: ResponseRecord, fresh: bool = False
                 ) -> AsyncGenerator[list[dict[str, Any]], None]:
    """The response's events from the first, in lists as they come: made from its
    job's token log while the job keeps it; after, from the final object (each
    item whole, the last event numbered as it was first sent). ``fresh``: the
    job was just submitted (its record is there: not read to see)."""
    writer = record.writer()
    yield writer.opening()
    try:
        if not fresh:
            await client.status(record.job_id)
    except JobNotFound:
        if record.final is None:
            await finish(client, record, None)
        assert record.final is not None
        yield writer.replay(record.final)
        return
    async for batch in client.stream_batches(record.job_id):
        if out := writer.feed(batch):
            yield out
    out = writer.close(await client.status(record.job_id))
    if record.final is None:
        await store(client, record, out[-1])
    yield out
