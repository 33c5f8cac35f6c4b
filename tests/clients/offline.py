"""What the client scripts here share: nothing may go past the machine (an audit
hook refuses any socket connection or lookup but a loopback address, so a
download fails loudly), and the failure a script reports as its own."""

from __future__ import annotations

from typing import Any

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def local_only(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple) and address[0] not in LOOPBACK:
            raise RuntimeError(f"a connection to {address} was attempted: nothing may download")
    elif event == "socket.getaddrinfo" and args[0] not in LOOPBACK:
        raise RuntimeError(f"a lookup of {args[0]!r} was attempted: nothing may download")


class Fail(Exception):
    """What differed from what the script checks."""
