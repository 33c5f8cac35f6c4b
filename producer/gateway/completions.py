"""OpenAI-compatible ``POST /v1/completions``: the request checked as
``tokenfleet.openai.completions`` checks it (every field honoured or refused by
name), its jobs submitted as the caller's API key allows, and the answer whole or
streamed. A client that disconnects before its completion is done cancels its
jobs, so the workers' slots are freed (``tokenfleet.gateway.answer``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.gateway import sse
from tokenfleet.gateway.answer import chunks, json_answer, succeeded
from tokenfleet.gateway.error_response import error_response
from tokenfleet.gateway.key_limits import submit_as_caller
from tokenfleet.gateway.metrics import first_token
from tokenfleet.openai.completions import (Completion, completion_choice, completions,
                                           completions_answer)
from tokenfleet.openai.echo import EchoedLogprobs, echo_text, from_worker
from tokenfleet.openai.errors import INVALID_VALUE, OpenAIError
from tokenfleet.openai.logprobs import CompletionLogprobs
from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.wire.schemas import GenerationRequest, TokenEvent


async def submit_constrained(request: Request, client: AsyncFleetClient,
                             jobs: list[GenerationRequest], n: int, field: str | None
                             ) -> list[str] | Response:
    """Submit the ``n`` choices of each of ``jobs`` (a request's prompts) as the
    request's API key allows, all or none (the app maps the fleet's errors to
    statuses); a spec that does not compile, checked after the key's limits, is
    refused naming ``field``, the request's own name for it."""
    try:
        return await submit_as_caller(request, client, jobs, n=n)
    except InvalidRequest as exc:
        if field is None or [e.get("loc") for e in exc.errors] != [["structured_output"]]:
            raise
        return error_response(INVALID_VALUE.error(f"invalid {field!r}: {exc.errors[0]['msg']}",
                                                  param=field))


async def complete(client: AsyncFleetClient, body: bytes, request: Request,
                   keepalive_s: float) -> Response:
    parts = await completions(client, body)
    if isinstance(parts, OpenAIError):
        return error_response(parts)
    job_ids = await submit_constrained(request, client, [part.job for part in parts],
                                       parts[0].n, parts[0].field)
    if isinstance(job_ids, Response):
        return job_ids
    made = parts[0]
    if made.ask.stream:
        return sse.response(streamed(client, parts, job_ids, request), keepalive_s)
    states = await succeeded(client, job_ids, request)
    if isinstance(states, Response):
        return states
    return await json_answer(await completions_answer(client, parts, job_ids, states),
                             heavy=made.ask.logprobs is not None)


def streamed(client: AsyncFleetClient, parts: list[Completion], job_ids: list[str],
             request: Request) -> AsyncIterator[bytes]:
    """The completion's chunks. An echo opens each choice: at once with a text
    prompt alone; else with the job's first event, which carries the prompt's
    text and log probabilities as the worker wrote them."""
    made = parts[0]
    asks = [part.ask for part in parts for _ in range(part.n)]  # choice i's
    opening, text_of = None, None
    if from_worker(made.ask):
        def text_of(i: int, event: TokenEvent) -> str:
            return echo_text(asks[i], event) + event.text
    elif made.echo:
        opening = [completion_choice(0, part.echo, None) for part in parts for _ in range(part.n)]
    shape: Callable[[int], Any] | None = None
    if made.ask.logprobs is not None:
        def shape(i: int) -> Any:
            return made.ask.named_shape(EchoedLogprobs(asks[i]) if made.ask.echo
                                        else CompletionLogprobs())
    return chunks(client, job_ids, made.head(job_ids[0]), completion_choice,
                  made.ask.include_usage, opening, logprobs=shape,
                  continuous_usage=made.ask.continuous_usage, per_prompt=made.n,
                  on_first_token=lambda: first_token(request.scope), text_of=text_of)
