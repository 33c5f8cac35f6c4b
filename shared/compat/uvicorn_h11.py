"""uvicorn's h11 protocol with a deadline and a size bound on each request's head, and
a lingering close.

uvicorn has no public hook for either: an ASGI app sees a request only once its
head is complete, and a closed connection is uvicorn's to close. So this module
subclasses ``uvicorn.protocols.http.h11_impl.H11Protocol`` (uvicorn accepts a
protocol class as ``http=``) and relies on what :data:`HOOKS` and
:data:`ATTRIBUTES` name: uvicorn calls ``handle_events`` after feeding received
bytes to h11, ``on_response_complete`` when a response has gone out, and keeps
the connection's ``h11.Connection`` in ``conn``, its event loop in ``loop`` and
its transport in ``transport``. ``tests/test_compat_uvicorn_h11.py`` pins each.

The head may take ``MAX_HEAD_BYTES``: h11 has that bound too, but checks it only
while the head is incomplete, so a head that arrives whole in one read passed at
any size (~100 KB heads were served). The shim measures the head as it comes,
before h11 parses it, and answers one over the bound with a 431.

The head's clock starts when the connection opens, or when the previous
response on it ends, and no byte received resets it. A client still sending
when its connection is closed gets a lingering close (:class:`_LingeringClose`):
closed at once, the socket holds bytes nobody read, so the kernel answers with
a reset instead of a FIN, and the reset can reach the client before it reads the
408, which then never arrives (``Connection reset by peer``). So such a
connection is closed as web servers do it (nginx's ``lingering_close``): the
write side first, then what still comes is read and dropped until the client
closes, for ``LINGER_S`` at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# The methods of H11Protocol overridden here, which uvicorn must go on calling.
HOOKS = ("connection_made", "data_received", "handle_events", "on_response_complete",
         "connection_lost")
# The attributes of an H11Protocol read here.
ATTRIBUTES = ("conn", "loop", "transport")

# The longest a connection whose client was still sending is read after its
# response, before it is closed anyway.
LINGER_S = 2.0

# The most bytes a request's head (request line and header fields) may take:
# h11's default bound on an incomplete event, which the gateway sets explicitly.
MAX_HEAD_BYTES = 16 * 1024

# Written to a connection whose head is larger than MAX_HEAD_BYTES.
_TOO_LARGE_TEXT = f"request head is larger than {MAX_HEAD_BYTES} bytes\n".encode()
HEAD_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                  b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                  b"content-length: " + str(len(_TOO_LARGE_TEXT)).encode() + b"\r\n\r\n"
                  + _TOO_LARGE_TEXT)

# Written to a connection whose head did not come in time, if part of it came.
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                   b"connection: close\r\ncontent-length: 34\r\n\r\n"
                   b"request head not received in time\n")


class _LingeringClose:
    """A transport whose ``close()``, while ``peer_sending()`` says the client
    may still be sending, shuts the write side only (a FIN after what is
    buffered) and closes for good when the client closes or after ``LINGER_S``."""

    def __init__(self, transport: asyncio.Transport, peer_sending: Callable[[], bool]) -> None:
        self._transport = transport
        self._peer_sending = peer_sending
        self._timer: asyncio.TimerHandle | None = None
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        transport = self._transport
        if self.lingering or transport.is_closing():
            return
        if not (self._peer_sending() and transport.can_write_eof()):  # TLS cannot half-close
            transport.close()
            return
        self.lingering = True
        transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def closed(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head does not arrive
    within ``head_timeout_s`` (a class attribute: see :func:`head_deadline_protocol`),
    and closing one whose client is still sending with a linger (:class:`_LingeringClose`).

    Runs on the server's event loop, like its base class.
    """

    head_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._lingering: _LingeringClose | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._lingering = _LingeringClose(transport, self._peer_sending)
        super().connection_made(cast(asyncio.Transport, self._lingering))
        self._arm()

    def _peer_sending(self) -> bool:
        """Whether a request is coming in unfinished: part of a head, or a body."""
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None and self._lingering.lingering:
            return  # the response is out; what the client still sends is dropped
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            self._disarm()
            self.conn.receive_data(data)  # buffered, never parsed: the close lingers
            self.transport.write(HEAD_TOO_LARGE)
            self.transport.close()
            return
        super().data_received(data)

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the head coming in (what h11 holds of it, and ``data``) passes
        ``MAX_HEAD_BYTES``, whole or not yet whole."""
        buffered = self.conn.trailing_data[0] + data
        end = buffered.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
        return (len(buffered) if end < 0 else end + 4) > MAX_HEAD_BYTES

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a head came (or the connection broke)
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's head is due from now on (a pipelined one has
        # already been read, and left their_state past IDLE).
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._lingering is not None:
            self._lingering.closed()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why the connection ends
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()


def head_deadline_protocol(head_timeout_s: float) -> type[HeadDeadlineProtocol]:
    """The protocol class to give uvicorn (``http=``) for this limit."""
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout_s": head_timeout_s})
