"""What every route reads off a request: its body within the gateway's limit
(an OpenAI route's refused in OpenAI's shape), the app's one fleet client, and
the event streams' keep-alive interval."""

from __future__ import annotations

from typing import cast

from fastapi import Request
from fastapi.responses import Response

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.gateway.error_response import error_response
from tokenfleet.openai.errors import TOO_LARGE


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(
            f"request body is larger than this gateway's limit of {limit} bytes "
            "(TOKENFLEET_MAX_PAYLOAD_BYTES): send a shorter prompt or raise the limit"
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused as soon as it passes ``limit`` bytes (before any parsing).

    A declared Content-Length is checked first; a chunked body is counted as it
    arrives, so an oversized one is never held in memory whole.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(limit)
    return bytes(body)


def fleet(request: Request) -> AsyncFleetClient:
    return cast(AsyncFleetClient, request.app.state.fleet)


def keepalive_s(request: Request) -> float:
    return fleet(request).settings.sse_keepalive_s


async def openai_body(request: Request) -> bytes | Response:
    """An OpenAI route's body, or the 413 in OpenAI's shape that refuses it."""
    try:
        return await read_body(request, fleet(request).settings.max_payload_bytes)
    except BodyTooLarge as exc:
        return error_response(TOO_LARGE.error(str(exc)))
