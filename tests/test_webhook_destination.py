"""Where a webhook may go, with no Redis and no network: every form of an
internal address refused at submit, and at connect every address a name
resolves to (the resolver patched)."""

from __future__ import annotations

import asyncio

import pytest

from tokenfleet.shared.settings import Settings
from tokenfleet.shared.webhook_destination import destination_problem, parse_allow, policy_of
from tokenfleet.webhooks.connect import DestinationRefused, GuardedBackend, connection_pool, post

REDIS = "redis://10.1.2.3:6379/0"

# Each form a resolver reads as an internal address, and what it is.
INTERNAL = {
    "http://127.0.0.1:8080/": "loopback",
    "http://2130706433:8080/": "loopback",  # decimal
    "http://0x7f000001:8080/": "loopback",  # hex
    "http://0177.0.0.1:8080/": "loopback",  # octal
    "http://127.1/": "loopback",  # short form
    "http://[::1]:8080/": "loopback",
    "http://[::ffff:127.0.0.1]/": "loopback",  # IPv6-mapped
    "http://[::ffff:10.0.0.1]/": "private",
    "http://localhost:8080/admin": "loopback name",
    "http://api.localhost/": "loopback name",
    "http://10.0.0.7/": "private",
    "http://192.168.1.1/": "private",
    "http://172.16.0.1/": "private",
    "http://[fd00::1]/": "private",
    "http://169.254.169.254/latest/meta-data/": "link-local",
    "http://[fe80::1]/": "link-local",
    "http://224.0.0.1/": "multicast",
    "http://0.0.0.0/": "unspecified",
    "http://[::]/": "unspecified",
    "http://100.64.0.1/": "non-public",
}


def settings(allow: str = "", redis_url: str = REDIS) -> Settings:
    return Settings(redis_url=redis_url, webhook_allow=allow)


def test_every_form_of_an_internal_address_is_refused_at_submit_naming_why() -> None:
    for url, kind in INTERNAL.items():
        problem = destination_problem(url, settings())
        assert problem is not None, url
        assert "webhook_url" in problem and kind in problem, (url, problem)
        assert "TOKENFLEET_WEBHOOK_ALLOW" in problem
    assert destination_problem("https://hooks.example.com/x", settings()) is None
    assert destination_problem("http://93.184.216.34:8080/", settings()) is None


def test_credentials_and_other_schemes_are_refused_at_submit() -> None:
    assert "credentials" in destination_problem("http://user:pw@hooks.example.com/", settings())
    assert "credentials" in destination_problem("http://admin@hooks.example.com/", settings())
    for url in ("file:///etc/passwd", "gopher://hooks.example.com/", "ftp://a.example/"):
        assert "http" in destination_problem(url, settings()), url


def test_the_fleets_redis_is_refused_by_name_and_its_port_even_when_allowed() -> None:
    named = settings(redis_url="redis://redis.internal:6379/0")
    assert "Redis host" in destination_problem("http://redis.internal:8080/", named)
    allowed = settings("10.0.0.0/8")
    assert destination_problem("http://10.1.2.3:8080/", allowed) is None
    assert "the fleet's Redis" in destination_problem("http://10.1.2.3:6379/", allowed)


def test_the_allowlist_takes_cidrs_and_hosts_with_or_without_a_port() -> None:
    allowed = settings("127.0.0.0/8, 10.9.0.1:9009, localhost:8080")
    assert destination_problem("http://127.0.0.5:1234/", allowed) is None
    assert destination_problem("http://10.9.0.1:9009/", allowed) is None
    assert destination_problem("http://10.9.0.1:9010/", allowed) is not None  # another port
    assert destination_problem("http://localhost:8080/", allowed) is None
    assert destination_problem("http://localhost:8081/", allowed) is not None
    assert destination_problem("http://[::1]/", allowed) is not None  # v6 loopback not named
    with pytest.raises(ValueError, match="TOKENFLEET_WEBHOOK_ALLOW"):
        parse_allow("hooks.example.com/path")


def backend(answers: dict[str, list[str]], allow: str = "") -> tuple[GuardedBackend, list[str]]:
    """A connector whose resolver answers from ``answers`` (and records each lookup)."""
    asked: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        asked.append(host)
        return answers[host]

    return GuardedBackend(policy_of(settings(allow)), resolver), asked


def test_at_connect_a_name_resolving_to_an_internal_address_is_refused() -> None:
    guard, _ = backend({"rebind.example.com": ["127.0.0.1"],
                        "mixed.example.com": ["93.184.216.34", "10.0.0.1"],
                        "v6.example.com": ["::ffff:169.254.169.254"],
                        "public.example.com": ["93.184.216.34"],
                        "redis.example.com": ["10.1.2.3"]})
    for host, why in (("rebind.example.com", "loopback"), ("mixed.example.com", "private"),
                      ("v6.example.com", "link-local"), ("redis.example.com", "Redis")):
        with pytest.raises(DestinationRefused, match=why):
            asyncio.run(guard.checked_address(host, 6379))
    assert str(asyncio.run(guard.checked_address("public.example.com", 443))) == "93.184.216.34"


def test_at_connect_a_literal_address_is_checked_without_a_lookup() -> None:
    guard, asked = backend({})
    for host in ("0x7f000001", "2130706433", "0177.0.0.1", "[::1]", "::ffff:127.0.0.1"):
        with pytest.raises(DestinationRefused, match="loopback"):
            asyncio.run(guard.checked_address(host, 80))
    assert asked == []


def test_at_connect_an_allowed_name_may_be_internal_but_never_the_redis_port() -> None:
    guard, _ = backend({"hooks.internal": ["10.1.2.3"]}, allow="hooks.internal")
    assert str(asyncio.run(guard.checked_address("hooks.internal", 8080))) == "10.1.2.3"
    with pytest.raises(DestinationRefused, match="the fleet's Redis"):
        asyncio.run(guard.checked_address("hooks.internal", 6379))


def test_a_refused_destination_is_an_attempt_refused_with_no_connection_made() -> None:
    async def attempt() -> object:
        async def resolver(host: str, port: int) -> list[str]:
            return ["127.0.0.1"]

        pool = connection_pool(policy_of(settings()), 4, resolver)
        async with pool:
            return await post(pool, "http://rebind.example.com:9/", b"{}", {}, 2.0)

    outcome = asyncio.run(attempt())
    assert outcome.refused and not outcome.delivered  # type: ignore[attr-defined]
    assert "loopback" in outcome.error  # type: ignore[attr-defined]
