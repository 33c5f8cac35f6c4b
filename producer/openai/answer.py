"""What a request's answer is made of, once its jobs have ended: their token logs
(read a page at a time), their events, finish reasons, usage, and the refusal a
failed job answers. No HTTP: the gateway's routes and a batch's lines both use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.client.protocol import EventCursor
from tokenfleet.openai.errors import JOB_FAILED, JOB_REFUSED, Refusal
from tokenfleet.shared.wire.schemas import REFUSED_BY_WORKER, FinishReason, JobState, TokenEvent

# Log entries read per XRANGE of a finished job's log.
LOG_PAGE = 256
FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


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


def finish(state: JobState) -> str:
    return FINISH.get(state.finish_reason, "stop") if state.finish_reason else "stop"


def usage(states: list[JobState], per_prompt: int | None = None) -> dict[str, int]:
    """The tokens of a request's choices (in their order, ``per_prompt`` choices
    to each of its prompts: all of them, unless given): each prompt counted
    once, as OpenAI does."""
    per_prompt = per_prompt or len(states) or 1
    prompt = sum(state.num_prompt_tokens or 0 for state in states[::per_prompt])
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
