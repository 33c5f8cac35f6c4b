"""OpenAI-compatible ``POST /v1/chat/completions``: the chat checked as
``tokenfleet.openai.chat`` checks it, its jobs submitted as the caller's API key
allows, and the answer whole or streamed (with the tool-call shapes the request
asked for)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.gateway import sse
from tokenfleet.gateway.answer import chunks, json_answer, succeeded
from tokenfleet.gateway.completions import submit_constrained
from tokenfleet.gateway.error_response import error_response
from tokenfleet.gateway.metrics import first_token
from tokenfleet.openai.chat import OPENING, chat_answer, chat_choice, chat_request
from tokenfleet.openai.errors import OpenAIError
from tokenfleet.openai.logprobs import chat_logprobs
from tokenfleet.openai.tools import auto_stream_choice


async def chat(client: AsyncFleetClient, body: bytes, request: Request,
               keepalive_s: float) -> Response:
    made = await chat_request(client, body)
    if isinstance(made, OpenAIError):
        return error_response(made)
    job_ids = await submit_constrained(request, client, [made.job], made.n, made.field)
    if isinstance(job_ids, Response):
        return job_ids
    if made.ask.stream:
        stream = {**made.head(job_ids[0]), "object": "chat.completion.chunk"}
        call = made.call
        choose, opening = ((chat_choice, OPENING) if call is None
                           else (call.stream_choice(), call.opening()))
        if made.fmt:
            choose = auto_stream_choice(made.fmt)
        return sse.response(chunks(client, job_ids, stream, choose, made.ask.include_usage,
                                   opening=opening,
                                   logprobs=(lambda _choice: made.ask.named_shape(chat_logprobs))
                                   if made.ask.logprobs
                                   else None,
                                   on_first_token=lambda: first_token(request.scope),
                                   continuous_usage=made.ask.continuous_usage),
                            keepalive_s)
    states = await succeeded(client, job_ids, request)
    if isinstance(states, Response):
        return states
    return await json_answer(await chat_answer(client, made, job_ids, states),
                             heavy=bool(made.ask.logprobs))
