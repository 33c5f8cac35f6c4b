"""Redis URLs as the fleet shows them: never with a password."""

from __future__ import annotations

import pytest

from tokenfleet.shared.redis.url import node_url, redacted


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://app:s3cret@cache:6379/0", "redis://app:***@cache:6379/0"),
    ("rediss://:s3cret@cache/2?ssl_cert_reqs=none", "rediss://:***@cache/2?ssl_cert_reqs=none"),
    ("redis+cluster://app:p@ss@[::1]:7000", "redis+cluster://app:***@[::1]:7000"),
    ("redis://app:s3cret@cache:port/0", "redis://app:***@cache:port/0"),  # too bad to connect to
    ("redis://cache:6379/0", "redis://cache:6379/0"),
    ("redis://app@cache:6379", "redis://app@cache:6379"),
    ("unix:///run/redis.sock?db=1&password=s3cret", "unix:///run/redis.sock?db=1&password=***"),
    ("redis://cache?password=", "redis://cache?password="),
])
def test_a_shown_url_keeps_everything_but_the_password(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_a_node_url_keeps_the_credentials_and_takes_the_plain_scheme() -> None:
    assert node_url("rediss+cluster://app:pw@a:7000/0", "10.0.0.2", 7001) == \
        "rediss://app:pw@10.0.0.2:7001/0"
    assert node_url("redis+cluster://a:7000", "::1", 7001) == "redis://[::1]:7001"
