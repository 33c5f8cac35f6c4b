"""The fault-injection suite: figures collected per test, printed at the end."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from helpers import FIGURES


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    figures: dict[str, Any] = {}
    yield figures
    if figures:
        FIGURES.append((request.node.name, figures))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.section("fault-injection figures")
    for name, figures in FIGURES:
        line = ", ".join(f"{k} {v}" for k, v in figures.items())
        terminalreporter.write_line(f"{name}: {line}")


@pytest.fixture
def aof_redis(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A redis-server of this test's own, with its append-only file on; with
    ``--redis cluster``, a cluster of three masters of its own, all restarted
    together (``stop``, ``start``)."""
    from helpers import own_redis

    server = own_redis(request.config.getoption("--redis") == "cluster", appendonly=True)
    yield server
    server.close()
