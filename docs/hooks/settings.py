"""MkDocs hook: the settings reference, rendered from ``Settings`` at build time.

``settings.md`` holds the line ``<!-- settings-table -->``; this hook puts in its
place one table row per field of ``tokenfleet.shared.settings.Settings``: the
environment variable, the processes that read it (``shared/settings_readers.py``),
the type with its bounds, the default and the field's ``description``. The reference is the code's
own list, so it cannot leave a
setting out.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.shared.settings import Settings
from tokenfleet.shared.settings_check import env_name, type_text
from tokenfleet.shared.settings_readers import READ_BY

MARKER = "<!-- settings-table -->"
PAGE = "settings.md"

__all__ = ["env_name", "on_page_markdown", "render_table", "type_text"]


def default_text(value: Any) -> str:
    """A default as it would be written in the environment."""
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def default_of(field: Any) -> str:
    """A field's default; one a function of the fleet's computes is told by its docstring."""
    factory = field.default_factory
    if factory is None:
        return default_text(field.default)
    if getattr(factory, "__module__", "").startswith("tokenfleet") and factory.__doc__:
        return " ".join(factory.__doc__.split()).replace("``", "`")
    return default_text(factory())


def render_table() -> str:
    """The reference table, one row per settings field, in the class's order.

    Raises ``ValueError`` for a field without a description, which fails the build.
    """
    rows = ["| variable | read by | type | default | what it sets |",
            "| --- | --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        if not field.description:
            raise ValueError(f"Settings.{name} has no description: the reference would leave "
                             f"{env_name(name)} unexplained; add Field(description=...)")
        if name not in READ_BY:
            raise ValueError(f"Settings.{name} has no entry in shared/settings_readers.py: say "
                             "which process reads it (client, gateway, worker)")
        text = type_text(field.annotation, field.metadata)
        desc = field.description.replace("|", "\\|")
        rows.append(f"| `{env_name(name)}` | {READ_BY[name]} | {text} | {default_of(field)} | {desc} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Puts the table in the settings page; every other page passes unchanged."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its {MARKER} line: the settings table has no place")
    return markdown.replace(MARKER, render_table())
