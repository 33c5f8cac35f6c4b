"""How the bench's modes print a figure (those that print lines of their own)."""

from __future__ import annotations

from typing import Any


def num(value: Any, digits: int = 0) -> str:
    """``value`` with thousands separators and ``digits`` decimals; '-' for None."""
    return "-" if value is None else f"{value:,.{digits}f}"
