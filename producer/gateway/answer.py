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

from tokenfleet.gateway.error_response import error_response
from tokenfleet.gateway import sse
from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.openai.answer import failed, failure, finish, usage
from tokenfleet.gateway.fanout import cancel_quietly, merged_batches, wait_while_connected
from tokenfleet.shared.wire.schemas import JobState, JobStatus, TokenEvent

Choice = Callable[[int, str, "str | None"], dict[str, Any]]
Logprobs = Callable[[list[TokenEvent]], dict[str, Any]]


async def chunks(client: AsyncFleetClient, job_ids: list[str], head: dict[str, Any],
                 choice: Choice, include_usage: bool,
                 opening: dict[str, Any] | list[dict[str, Any]] | None = None,
                 logprobs: Callable[[int], Logprobs] | None = None,
                 on_first_token: Callable[[], None] | None = None,
                 continuous_usage: bool = False,
                 per_prompt: int | None = None,
                 text_of: Callable[[int, TokenEvent], str] | None = None
                 ) -> AsyncIterator[bytes]:
    """The jobs' text as OpenAI stream chunks, one choice each (``choice`` shapes
    one; job i is choice i): ``opening`` first for each choice, if given (one
    for all, or choice i's at i), sent with the first chunk that follows it, not
    before the jobs make anything (as vLLM does: a client that times the first
    chunk, such as ``vllm bench serve``, times the first token); a
    chunk per piece of text (per event, with its tokens' ``logprobs`` shaped by
    a shape made per choice, ``logprobs(i)``, when asked for: an event whose text is held back
    still has tokens), the choices' interleaved as they come; each choice's
    finish reason (or the first error: the other choices are then cancelled);
    the usage if asked for (``per_prompt`` choices to a prompt, as
    :func:`usage` counts them); ``[DONE]``. ``on_first_token()`` is called as the
    first chunk of generated text goes (the gateway's TTFT). With
    ``continuous_usage`` (vLLM's ``continuous_usage_stats``) every chunk of a
    choice carries that choice's usage so far. ``text_of(i, event)`` is an
    event's text in choice i's chunk, where it is more than the event's own (an
    echo the worker wrote)."""
    text_of = text_of or _own_text
    shapes = None if logprobs is None else [logprobs(i) for i in range(len(job_ids))]
    counts = RunningUsage(len(job_ids)) if continuous_usage else None
    # Closed on the way out (a failed choice, a client gone): the other choices'
    # subscriptions end then, not when the generator is collected.
    async with cancel_unless_ended(client, job_ids) as ended, \
            contextlib.aclosing(merged_batches(client, job_ids)) as batches:
        held = b""  # the opening, until the first chunk goes
        if opening is not None:
            openings = opening if isinstance(opening, list) else [opening] * len(job_ids)
            held = b"".join(data({**head, "choices": [{**shown, "index": i}]})
                            for i, shown in enumerate(openings))
        states: dict[int, JobState] = {}
        async for index, events in batches:
            if events is not None:
                shape = None if shapes is None else shapes[index]
                # A backlog goes out as one write: the same chunks, fewer frames.
                frame = b"".join(
                    data({**head, "choices": [_with(choice(index, text, None), e, shape)],
                          **({} if counts is None else {"usage": counts.after(index, e)})})
                    for e in events if (text := text_of(index, e)) or shape)
                if frame:
                    if on_first_token is not None:
                        on_first_token()
                        on_first_token = None
                    yield held + frame
                    held = b""
                continue
            state = await client.status(job_ids[index])
            if state.status is not JobStatus.SUCCEEDED:
                why = failed(state)
                yield held + data({"error": {"message": failure(state), "type": why.type,
                                             "param": None, "code": why.code}})
                yield b"data: [DONE]\n\n"
                return  # leaving the block cancels the other choices
            states[index] = state
            yield held + data({**head, "choices": [choice(index, "", finish(state))],
                               **({} if counts is None else {"usage": usage([state])})})
            held = b""
        ended.set()
        if include_usage:
            yield data({**head, "choices": [],
                        "usage": usage([states[i] for i in sorted(states)], per_prompt)})
        yield b"data: [DONE]\n\n"


def _own_text(_index: int, event: TokenEvent) -> str:
    return event.text


class RunningUsage:
    """Each choice's usage as its stream goes: the prompt's tokens (from its
    first event) and the tokens made so far."""

    def __init__(self, choices: int) -> None:
        self._prompt = [0] * choices

    def after(self, index: int, event: TokenEvent) -> dict[str, int]:
        """Choice ``index``'s usage once ``event`` is sent."""
        if event.prompt_tokens is not None:
            self._prompt[index] = event.prompt_tokens
        prompt = self._prompt[index]
        return {"prompt_tokens": prompt, "completion_tokens": event.end,
                "total_tokens": prompt + event.end}


def _with(choice: dict[str, Any], event: TokenEvent, logprobs: Logprobs | None
          ) -> dict[str, Any]:
    if logprobs is not None:
        choice["logprobs"] = logprobs([event])
    return choice


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
            return error_response(failed(state).error(failure(state)))
    return states


def data(obj: dict[str, Any]) -> bytes:
    return sse.event(orjson.dumps(obj))
