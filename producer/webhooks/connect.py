"""One webhook attempt: a POST that ends within its time budget, reads no more
than a few KB of the answer, and connects only to an address allowed.

- **Time**: the whole attempt (connect, send, the status and the first
  ``MAX_ANSWER`` bytes) is bounded by ``webhook_timeout_s`` together, not each
  read: a receiver that drips one byte every few seconds, or never answers,
  holds its slot for that long and no longer.
- **Size**: the answer's status line and headers are read (h11 bounds them),
  then at most ``MAX_ANSWER`` bytes of the body, which are discarded; the rest
  is never read (the connection is closed). Nothing of the body is stored: a
  tenant's receiver could otherwise make the fleet fetch an internal page and
  show it back through the attempt's record.
- **Where**: :class:`GuardedBackend` resolves the host itself, checks every
  address it resolves to (``webhook_destination.address_problem``) and connects
  to one of them, so the connection goes where the check looked. Redirects are
  not followed, no proxy from the environment is used, and TLS still checks the
  certificate of the host named in the URL.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpcore

from tokenfleet.shared.webhook_destination import (
    Address,
    Policy,
    address_problem,
    literal_address,
    redis_endpoint_problem,
    refusal,
)

# The most of an answer's body read (and thrown away) before the connection is closed.
MAX_ANSWER = 4096
# Longest error text stored with an attempt.
MAX_ERROR = 300
# How long the Redis host's addresses are kept before they are looked up again.
OWN_ADDRESSES_S = 60.0

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the loop's ``getaddrinfo``)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True)
class Outcome:
    """One attempt: the receiver's HTTP status, or why there was none;
    ``refused`` when the destination is not allowed (no retry helps)."""

    status: int | None
    error: str
    refused: bool = False

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


class DestinationRefused(httpcore.ConnectError):
    """The host resolved to an address a webhook may not reach."""


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to checked addresses."""

    def __init__(self, policy: Policy, resolver: Resolver = resolve,
                 inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.policy, self.resolver = policy, resolver
        self.inner = inner or httpcore.AnyIOBackend()
        self._own: frozenset[Address] = frozenset()
        self._own_at = float("-inf")

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None
                          ) -> httpcore.AsyncNetworkStream:
        address = await self.checked_address(host, port)
        return await self.inner.connect_tcp(str(address), port, timeout=timeout,
                                            local_address=local_address,
                                            socket_options=socket_options)

    async def checked_address(self, host: str, port: int) -> Address:
        """The address to connect to: the first ``host`` resolves to, once
        every one of them passed (one refused refuses the host: which one a
        client gets is the resolver's choice, not ours)."""
        host = host.strip("[]")
        literal = literal_address(host)
        found = [literal] if literal is not None else [
            a for a in map(literal_address, await self.resolver(host, port)) if a is not None]
        if not found:
            raise httpcore.ConnectError(f"{host} resolved to no address")
        # A name the operator allows may resolve anywhere but to Redis itself.
        check = redis_endpoint_problem if literal is None and self.policy.allows_name(
            host, port) else address_problem
        own = await self._own_addresses()
        for address in found:
            why = check(address, port, self.policy, own)
            if why:
                raise DestinationRefused(why if literal is not None else
                                         f"{host} resolves to {address}, refused ({why})")
        return found[0]

    async def _own_addresses(self) -> frozenset[Address]:
        """The Redis host's addresses (a name is looked up again each minute)."""
        host = self.policy.redis_host
        if not host or literal_address(host) is not None:
            return frozenset()
        if time.monotonic() - self._own_at >= OWN_ADDRESSES_S:
            try:
                found = await self.resolver(host, self.policy.redis_port)
            except OSError:
                found = []
            self._own = frozenset(a for a in map(literal_address, found) if a is not None)
            self._own_at = time.monotonic()
        return self._own

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("webhooks do not go to Unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def connection_pool(policy: Policy, max_connections: int,
                    resolver: Resolver = resolve) -> httpcore.AsyncConnectionPool:
    return httpcore.AsyncConnectionPool(
        ssl_context=ssl.create_default_context(), max_connections=max_connections,
        network_backend=GuardedBackend(policy, resolver))


async def post(pool: httpcore.AsyncConnectionPool, url: str, payload: bytes,
               headers: dict[str, str], timeout_s: float) -> Outcome:
    """POST ``payload`` to ``url``: the receiver's status, within ``timeout_s`` in all."""
    parts = urlsplit(url)
    head = [(b"host", parts.netloc.encode()), *((k.encode(), v.encode())
                                                 for k, v in headers.items()),
            (b"content-length", str(len(payload)).encode())]
    phases = {"connect": timeout_s, "read": timeout_s, "write": timeout_s, "pool": timeout_s}
    status: int | None = None
    reason = b""
    try:
        async with asyncio.timeout(timeout_s):
            async with pool.stream("POST", url, headers=head, content=payload,
                                   extensions={"timeout": phases}) as answer:
                status, reason = answer.status, answer.extensions.get("reason_phrase", b"")
                # The body is read only so that the connection may serve the next
                # event; past MAX_ANSWER, or the time budget, it is dropped with
                # the connection, and the status counts as it is.
                read = 0
                async for chunk in answer.aiter_stream():
                    read += len(chunk)
                    if read >= MAX_ANSWER:
                        break
    except (TimeoutError, httpcore.TimeoutException):
        if status is None:
            return Outcome(None, f"no answer within {timeout_s:g} s "
                           "(TOKENFLEET_WEBHOOK_TIMEOUT_S)")
    except DestinationRefused as exc:
        return Outcome(None, refusal(url, str(exc))[:MAX_ERROR], refused=True)
    except (httpcore.ProtocolError, httpcore.NetworkError, httpcore.UnsupportedProtocol,
            OSError, ssl.SSLError) as exc:
        if status is None:
            return Outcome(None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR] or type(exc).__name__)
    if status is None:  # not reached: the block ends with a status or an exception
        return Outcome(None, "no answer")
    if 200 <= status < 300:
        return Outcome(status, "")
    # The status and its reason phrase only: the body is the receiver's to
    # choose, and what is stored here an operator lists.
    said = "".join(c for c in bytes(reason).decode("latin-1")[:60] if c.isprintable())
    return Outcome(status, f"HTTP {status} {said}".rstrip())
