"""Server-side time limits of the gateway: on a request's head and on its body.

Without them a client that sends a byte now and then holds a connection (and
its memory) for as long as it likes, and a few hundred such clients exhaust the
server. uvicorn bounds neither: its keep-alive timeout runs only between two
requests and is cancelled by any byte received, and h11's limit on an incomplete
head bounds its size, not its time.

- The head: an ASGI app sees a request only once its head is complete, so this
  limit lives in the server, in uvicorn's h11 protocol with a deadline
  (:func:`head_deadline_protocol`, from ``tokenfleet.shared.compat.uvicorn_h11``,
  which ``gateway.server_config`` installs). The clock starts when the
  connection opens, or when the previous response on it ends, and no byte
  received resets it.
- The body: an ASGI middleware (:class:`BodyDeadline`), so it holds under any
  ASGI server. The clock starts when the head is complete; a body not whole
  by the deadline ends the request with a 408 and the connection is closed.

A connection whose client is still sending when either 408 goes out is closed
with a linger, so the client reads the 408 rather than a reset (see the compat module).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfleet.shared.compat.uvicorn_h11 import head_deadline_protocol as head_deadline_protocol


class BodyTimeout(Exception):
    def __init__(self, limit_s: float) -> None:
        super().__init__(
            f"the request body did not arrive within this gateway's limit of {limit_s:g} s "
            "(TOKENFLEET_BODY_TIMEOUT_S): send it at once, or raise the limit"
        )


class BodyDeadline:
    """Reading the body past ``timeout_s`` after the head raises :class:`BodyTimeout`
    (the app answers it with a 408 and ``Connection: close``)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        whole = False

        async def receive_in_time() -> Message:
            nonlocal whole
            if whole:  # what comes after the body (a disconnect) may take its time
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.timeout_s) from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)
