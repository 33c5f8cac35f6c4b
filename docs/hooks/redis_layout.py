"""MkDocs hook: the Redis layout table, rendered from ``Keys`` at build time.

``redis-layout.md`` holds the line ``<!-- redis-layout-table -->``; this hook puts in
its place one row per key of ``tokenfleet.shared.wire.keys.Keys``: the key as the code
names it (each argument shown as ``<argument>``), its type and what it holds, both
read from the docstring of the method or property that names it (``"Hash: the job
record."``). A key added to ``Keys`` appears in the table, and one without a
``Type: what it holds`` docstring fails the build.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from tokenfleet.shared.wire.keys import Keys

MARKER = "<!-- redis-layout-table -->"
PAGE = "redis-layout.md"

# Members of Keys that name no key: constructors, patterns for SCAN, a key's
# inverse (its model or queue), a job's keys at once (each is its own row).
NOT_KEYS = {"for_url", "queue_of", "declared_model", "served_model", "of_job"}
# An argument's sample value, where a placeholder would not be parsed as the
# code expects: a queue name and a job id (a queue, ':', a random part).
SAMPLES = {"model": "MODEL", "level": "MODEL", "job_id": "MODEL:HEX"}
SHOWN = {"NS": "<ns>", "MODEL": "<model>", "HEX": "<hex>"}
DOC = re.compile(r"(?P<type>[^:]+):\s*(?P<holds>.*)", re.S)


def key_members() -> list[str]:
    """The names of the members of ``Keys`` that name a key or channel, in source order."""
    names = [name for name in vars(Keys) if not name.startswith("_")]
    return [n for n in names if n not in NOT_KEYS and not n.endswith("_pattern")
            and (isinstance(vars(Keys)[n], property) or inspect.isfunction(vars(Keys)[n]))]


def key_name(member: str) -> str:
    """The key a member names, its arguments shown as ``<argument>``."""
    keys = Keys("NS")
    value = getattr(keys, member)
    if callable(value):
        params = inspect.signature(value).parameters
        value = value(*(SAMPLES.get(p, f"<{p.replace('_', ' ')}>") for p in params))
    if not isinstance(value, str):
        raise ValueError(f"Keys.{member} names no key (it gives {type(value).__name__}): add it "
                         "to NOT_KEYS in docs/hooks/redis_layout.py")
    for sample, shown in SHOWN.items():
        value = value.replace(sample, shown)
    return value


def describe(member: str) -> tuple[str, str]:
    """A key's type and what it holds, from its docstring."""
    raw = vars(Keys)[member]
    doc = inspect.getdoc(raw.fget if isinstance(raw, property) else raw) or ""
    found = DOC.match(doc)
    if found is None:
        raise ValueError(f"Keys.{member} has no 'Type: what it holds' docstring: the Redis "
                         "layout page would leave its key unexplained")
    text = " ".join(found["holds"].split()).replace("``", "`").replace("|", "\\|")
    # '<' outside code would open an HTML tag in the rendered page.
    parts = text.split("`")
    holds = "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))
    return found["type"].strip(), holds


def render_table() -> str:
    """The table, one row per key of ``Keys``, in the class's order."""
    rows = ["| key | type | holds | named by |", "| --- | --- | --- | --- |"]
    for member in key_members():
        kind, holds = describe(member)
        rows.append(f"| `{key_name(member)}` | {kind} | {holds} | `Keys.{member}` |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Puts the table in the Redis layout page; every other page passes unchanged."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its {MARKER} line: the key table has no place")
    return markdown.replace(MARKER, render_table())
