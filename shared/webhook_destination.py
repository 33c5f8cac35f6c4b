"""Where a webhook may go: a public address, or one the operator allows.

A tenant names the URL and the fleet connects to it from inside the fleet's
network, so without a check a tenant could post to a loopback admin port, a
cloud's metadata address (169.254.169.254) or the fleet's own Redis. A
destination is checked twice:

- at submit (:func:`url_problem`), the host as written: a literal address in any
  form a resolver takes (``2130706433``, ``0x7f000001``, ``0177.0.0.1``,
  ``127.1``, ``[::ffff:127.0.0.1]``) is that address; ``localhost`` and names
  under ``.localhost`` are loopback; the Redis host by its name. A name is not
  looked up there: its answer may change before the attempt.
- at connect (:func:`address_problem`, by the deliverer's connector), every
  address the name resolves to; the connection goes to one of the addresses
  checked, never to a second lookup that could answer otherwise (DNS rebinding).

Refused unless ``TOKENFLEET_WEBHOOK_ALLOW`` names it: loopback, private,
link-local, multicast, unspecified, reserved and any other address not globally
routable (``100.64.0.0/10``, ...), and the addresses of the fleet's Redis host.
The Redis endpoint itself (its address and port) is refused even then: no
receiver listens there, and Redis reads an HTTP request's lines as commands.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from tokenfleet.shared.webhook_outbox import webhook_url_problem

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ALLOW_SETTING = "TOKENFLEET_WEBHOOK_ALLOW"
DEFAULT_PORTS = {"http": 80, "https": 443}


class _Settings(Protocol):
    webhook_allow: str
    redis_url: str


@dataclass(frozen=True)
class Policy:
    """What the operator allows (``networks``: address ranges, ``names``: hosts
    as written, each with a port or None for any) and the fleet's own Redis
    endpoint (its host as written, lower case, and port)."""

    networks: tuple[tuple[Network, int | None], ...] = ()
    names: tuple[tuple[str, int | None], ...] = ()
    redis_host: str = ""
    redis_port: int = 6379

    def allows_name(self, host: str, port: int) -> bool:
        return any(name == host.lower() and want in (None, port) for name, want in self.names)

    def allows_address(self, address: Address, port: int) -> bool:
        return any(address in net and want in (None, port) for net, want in self.networks)


def parse_allow(text: str) -> tuple[tuple[tuple[Network, int | None], ...],
                                    tuple[tuple[str, int | None], ...]]:
    """``TOKENFLEET_WEBHOOK_ALLOW``: comma-separated CIDRs (any port) and
    ``host[:port]`` (an address, ``[v6]:port``, or a name as URLs write it)."""
    networks: list[tuple[Network, int | None]] = []
    names: list[tuple[str, int | None]] = []
    for entry in filter(None, (part.strip() for part in text.replace(" ", ",").split(","))):
        try:
            networks.append((ipaddress.ip_network(entry, strict=False), None))
            continue
        except ValueError:
            pass
        try:
            parts = urlsplit(f"//{entry}")
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ValueError(f"{ALLOW_SETTING}: {entry!r} is not a CIDR or host[:port] ({exc})"
                             ) from None
        if not host or parts.path or parts.username is not None:
            raise ValueError(f"{ALLOW_SETTING}: {entry!r} is not a CIDR or host[:port]")
        address = literal_address(host)
        if address is not None:
            networks.append((ipaddress.ip_network(address), port))
        else:
            names.append((host.lower().rstrip("."), port))
    return tuple(networks), tuple(names)


def policy_of(settings: _Settings) -> Policy:
    networks, names = parse_allow(settings.webhook_allow)
    redis = urlsplit(settings.redis_url)
    try:
        port = redis.port or 6379
    except ValueError:
        port = 6379
    return Policy(networks, names, (redis.hostname or "").lower().rstrip("."), port)


def literal_address(host: str) -> Address | None:
    """The address ``host`` spells, in any form ``getaddrinfo`` takes for one
    (IPv6, dotted quad, and the C library's ``inet_aton`` forms: one decimal
    number, hex, octal, fewer than four parts); None for a name."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _kind(address: Address) -> str | None:
    """Why ``address`` is no public receiver's, or None when it may be one."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:  # the v4 address it reaches
            return _kind(embedded)
    for kind, test in (("a loopback", address.is_loopback), ("an unspecified", address.is_unspecified),
                       ("a link-local", address.is_link_local),
                       ("a multicast", address.is_multicast), ("a private", address.is_private),
                       ("a reserved", address.is_reserved)):
        if test:
            return kind
    return None if address.is_global else "a non-public"


def _is_redis_host(address: Address, policy: Policy, redis_addresses: frozenset[Address]
                   ) -> bool:
    return address in redis_addresses or (
        bool(policy.redis_host) and literal_address(policy.redis_host) == address)


def redis_endpoint_problem(address: Address, port: int, policy: Policy,
                           redis_addresses: frozenset[Address] = frozenset()) -> str | None:
    """Refused whatever the allowlist says: the fleet's Redis itself."""
    if port == policy.redis_port and _is_redis_host(address, policy, redis_addresses):
        return f"{address} port {port} is the fleet's Redis"
    return None


def address_problem(address: Address, port: int, policy: Policy,
                    redis_addresses: frozenset[Address] = frozenset()) -> str | None:
    """Why a webhook may not connect to ``address`` at ``port``, or None."""
    endpoint = redis_endpoint_problem(address, port, policy, redis_addresses)
    if endpoint:
        return endpoint
    if policy.allows_address(address, port):
        return None
    kind = _kind(address)
    if kind is not None:
        return f"{address} is {kind} address"
    if _is_redis_host(address, policy, redis_addresses):
        return f"{address} is the fleet's Redis host"
    return None


def url_problem(url: str, policy: Policy) -> str | None:
    """Why ``url`` (already a well-formed webhook URL) may not be a webhook's
    destination, judged by its host as written; None when it may be."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    port = parts.port or DEFAULT_PORTS.get(parts.scheme, 80)
    address = literal_address(host)
    why: str | None
    if address is not None:
        why = address_problem(address, port, policy)
    elif host == policy.redis_host and not policy.allows_name(host, port):
        why = f"{host} is the fleet's Redis host"
    elif (host == "localhost" or host.endswith(".localhost")) and not policy.allows_name(
            host, port):
        why = f"{host} is a loopback name"
    else:
        why = None
    return None if why is None else refusal(url, why)


def refusal(url: str, why: str) -> str:
    return (f"webhook_url {url[:80]!r} is refused: {why}; webhooks go to public addresses "
            f"only, unless the operator allows an internal receiver ({ALLOW_SETTING})")


def destination_problem(url: str, settings: _Settings) -> str | None:
    """Everything submit checks of a webhook URL: its form, then its host."""
    return webhook_url_problem(url) or url_problem(url, policy_of(settings))
