"""Small test helpers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.02) -> Any:
    """Poll an external process's state (a server, a child process) until it holds.

    For state owned by another process there is no event to wait on; the poll is
    bounded, and the failure names what never happened.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
