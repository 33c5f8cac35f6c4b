"""The gateway's refusals as the docs list them are the ones the code gives: the table
in docs/errors.md against ``tokenfleet.openai.errors.REFUSALS``, and every error the
client raises has its row."""

from __future__ import annotations

from pathlib import Path

import tokenfleet
from tokenfleet.openai.errors import FLEET_ERRORS, REFUSALS, Refusal

PAGE = Path(__file__).resolve().parent.parent / "docs" / "errors.md"


def documented_rows() -> list[list[str]]:
    """The cells of each row of the table under "Every refusal"."""
    section = PAGE.read_text().split("## Every refusal", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header, _rule, *rows = lines
    assert header.startswith("| when | HTTP |"), header
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def as_row(refusal: Refusal) -> list[str]:
    return [refusal.when, str(refusal.status), f"`{refusal.type}`",
            f"`{refusal.code}`" if refusal.code else "-", "yes" if refusal.retry else "no",
            f"`{refusal.sentence}`"]


def test_the_docs_table_of_refusals_is_the_codes() -> None:
    assert documented_rows() == [as_row(r) for r in REFUSALS]


def test_every_error_the_client_raises_has_a_refusal_in_the_table() -> None:
    raised = {name for name in tokenfleet.__all__
              if isinstance(getattr(tokenfleet, name), type)
              and issubclass(getattr(tokenfleet, name), tokenfleet.TokenfleetError)
              and name != "TokenfleetError"}
    assert raised == set(FLEET_ERRORS)
    assert all(refusal in REFUSALS for refusal in FLEET_ERRORS.values())


def test_only_what_a_retry_can_fix_asks_for_one() -> None:
    for refusal in REFUSALS:
        asks = refusal.headers()
        assert asks["x-should-retry"] == ("true" if refusal.retry else "false")
        if refusal.retry and refusal.status in (429, 503):
            assert int(asks["Retry-After"]) > 0
    assert {r.status for r in REFUSALS if r.retry} == {408, 429, 503}
