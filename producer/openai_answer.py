"""From a request's jobs to OpenAI's answer: stream chunks of their text as it
comes, their final states, usage and failures; the completions and chat
endpoints shape their choices, this module the rest.

A client that disconnects before its jobs are done cancels them, so the
workers' slots are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from tokenfleet import sse
from tokenfleet.aio import AsyncFleetClient
from tokenfleet.openai_errors import JOB_FAILED, JOB_REFUSED, Refusal
from tokenfleet.openai_fanout import cancel_quietly, merged_batches, wait_while_connected
from tokenfleet.protocol import EventCursor
from tokenfleet.shared.schemas import REFUSED_BY_WORKER, FinishReason, JobState, JobStatus, TokenEvent

# Log entries read per XRANGE of a finished job's log.
LOG_PAGE = 256
FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}

Choice = Callable[[int, str, "str | None"], dict[str, Any]]
Logprobs = Callable[[list[TokenEvent]], dict[str, Any]]


async def chunks(client: AsyncFleetClient, job_ids: list[str], head: dict[str, Any],
                 choice: Choice, include_usage: bool, opening: dict[str, Any] | None = None,
                 logprobs: Callable[[], Logprobs] | None = None,
                 on_first_token: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """The jobs' text as OpenAI stream chunks, one choice each (``choice`` shapes
    one; job i is choice i): ``opening`` first for each choice, if given; a
    chunk per piece of text (per event, with its tokens' ``logprobs`` shaped by
    a shape made per choice, when asked for: an event whose text is held back
    still has tokens), the choices' interleaved as they come; each choice's
    finish reason (or the first error: the other choices are then cancelled);
    the usage if asked for; ``[DONE]``. ``on_first_token()`` is called as the
    first chunk of generated text goes (the gateway's TTFT)."""
    shapes = None if logprobs is None else [logprobs() for _ in job_ids]
    # Closed on the way out (a failed choice, a client gone): the other choices'
    # subscriptions end then, not when the generator is collected.
    async with cancel_unless_ended(client, job_ids) as ended, \
            contextlib.aclosing(merged_batches(client, job_ids)) as batches:
        if opening is not None:
            yield b"".join(data({**head, "choices": [{**opening, "index": i}]})
                           for i in range(len(job_ids)))
        states: list[JobState] = []
        async for index, events in batches:
            if events is not None:
                shape = None if shapes is None else shapes[index]
                # A backlog goes out as one write: the same chunks, fewer frames.
                frame = b"".join(
                    data({**head, "choices": [_with(choice(index, e.text, None), e, shape)]})
                    for e in events if e.text or shape)
                if frame:
                    if on_first_token is not None:
                        on_first_token()
                        on_first_token = None
                    yield frame
                continue
            state = await client.status(job_ids[index])
            if state.status is not JobStatus.SUCCEEDED:
                why = failed(state)
                yield data({"error": {"message": failure(state), "type": why.type,
                                      "param": None, "code": why.code}})
                yield b"data: [DONE]\n\n"
                return  # leaving the block cancels the other choices
            states.append(state)
            yield data({**head, "choices": [choice(index, "", finish(state))]})
        ended.set()
        if include_usage:
            yield data({**head, "choices": [], "usage": usage(states)})
        yield b"data: [DONE]\n\n"


def _with(choice: dict[str, Any], event: TokenEvent, logprobs: Logprobs | None
          ) -> dict[str, Any]:
    if logprobs is not None:
        choice["logprobs"] = logprobs([event])
    return choice


async def logged(client: AsyncFleetClient, job_id: str) -> list[bytes]:
    """A finished job's token log, its entries as written (whole: the job has
    ended), read a page at a time so that no one reply holds the loop; parsed
    by :func:`events`, off the loop where they are many."""
    log, start = client.keys.out(job_id), "-"
    out: list[bytes] = []
    while True:
        page = await client.redis.xrange(log, start, "+", count=LOG_PAGE)
        out.extend(fields[b"e"] for _id, fields in page)
        if len(page) < LOG_PAGE:
            return out
        start = f"({page[-1][0].decode()}"


async def shaped(client: AsyncFleetClient, job_ids: list[str], with_logprobs: bool,
                 body: Callable[[list[list[bytes]] | None], dict[str, Any]]) -> dict[str, Any]:
    """``body(logs)``, the answer: with log probabilities the jobs' logs are
    read here and ``body`` runs in a worker thread (n choices of 21 values a
    token are seconds of Python, the event loop's otherwise); else
    ``body(None)``, here."""
    if not with_logprobs:
        return body(None)
    logs = [await logged(client, job_id) for job_id in job_ids]
    return await asyncio.to_thread(body, logs)


def events(log: list[bytes]) -> list[TokenEvent]:
    """A job's token events from its log's entries, as a stream reads them (an
    attempt's repeated tokens once)."""
    cursor = EventCursor()
    for payload in log:
        cursor.feed(payload)
    return cursor.take()


async def json_answer(answer: dict[str, Any], heavy: bool) -> Response:
    """``answer`` as the endpoint's JSON; a ``heavy`` one (log probabilities:
    megabytes at the bounds) serialised off the event loop."""
    body = await asyncio.to_thread(orjson.dumps, answer) if heavy else orjson.dumps(answer)
    return Response(body, media_type="application/json")


@contextlib.asynccontextmanager
async def cancel_unless_ended(client: AsyncFleetClient, job_ids: list[str]
                              ) -> AsyncIterator[asyncio.Event]:
    """Cancels the jobs on exit unless the event was set: the client went away
    (or the stream broke, or a choice failed) before they all ended, so their
    work is of no use."""
    ended = asyncio.Event()
    try:
        yield ended
    finally:
        if not ended.is_set():
            await cancel_quietly(client, job_ids)


async def succeeded(client: AsyncFleetClient, job_ids: list[str], request: Request
                    ) -> list[JobState] | Response:
    """The succeeded jobs' states, in order, or the response that says why there
    are none: 499 when the client left first (the jobs are cancelled), else the
    first failed job's refusal (400 or 500)."""
    states = await wait_while_connected(client, job_ids, request)
    if states is None:
        return Response(status_code=499)  # nobody is left to read it
    for state in states:
        if state.status is not JobStatus.SUCCEEDED:
            return failed(state).response(failure(state))
    return states


def data(obj: dict[str, Any]) -> bytes:
    return sse.event(orjson.dumps(obj))


def finish(state: JobState) -> str:
    return FINISH.get(state.finish_reason, "stop") if state.finish_reason else "stop"


def usage(states: list[JobState]) -> dict[str, int]:
    """The tokens of a request's choices: their prompt counted once, as OpenAI does."""
    prompt = (states[0].num_prompt_tokens or 0) if states else 0
    completion = sum(len(state.token_ids) for state in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def failed(state: JobState) -> Refusal:
    """Why the job has no result: the request's fault (its worker refused it) or not."""
    refused = (state.error or "").startswith(REFUSED_BY_WORKER)
    return JOB_REFUSED if refused else JOB_FAILED


def failure(state: JobState) -> str:
    reason = state.error or (state.finish_reason.value if state.finish_reason else "no reason")
    return f"the job ended {state.status.value} ({reason}); the completion has no result"
