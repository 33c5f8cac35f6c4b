"""MkDocs hook: the settings reference, rendered from ``Settings`` at build time.

``settings.md`` holds the line ``<!-- settings-table -->``; this hook puts in its
place one table row per field of ``tokenfleet.shared.settings.Settings``: the
environment variable, the type with its bounds, the default and the field's
``description``. The reference is the code's own list, so it cannot leave a
setting out.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from tokenfleet.shared.settings import Settings

MARKER = "<!-- settings-table -->"
PAGE = "settings.md"

_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def env_name(field: str) -> str:
    """The environment variable that sets ``field``."""
    prefix = Settings.model_config.get("env_prefix", "")
    return f"{prefix}{field}".upper()


def _bounds(metadata: list[Any]) -> str:
    found = [f"{sign} {getattr(m, attr)}" for m in metadata
             for attr, sign in _BOUNDS if getattr(m, attr, None) is not None]
    return f" ({', '.join(found)})" if found else ""


def type_text(annotation: Any, metadata: list[Any] | None = None) -> str:
    """A type as a reader of the environment sees it: ``int (≥ 1)``, ``"hf" or "vllm"``."""
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *extra = get_args(annotation)
        nested = [m for e in extra for m in (e.metadata if isinstance(e, FieldInfo) else [e])]
        return type_text(inner, nested)
    if origin is Literal:
        return " or ".join(f'"{v}"' for v in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(a, metadata) for a in get_args(annotation))
    if annotation is type(None):
        return "unset"
    return getattr(annotation, "__name__", str(annotation)) + _bounds(metadata or [])


def default_text(value: Any) -> str:
    """A default as it would be written in the environment."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def render_table() -> str:
    """The reference table, one row per settings field, in the class's order.

    Raises ``ValueError`` for a field without a description, which fails the build.
    """
    rows = ["| variable | type | default | what it sets |", "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        if not field.description:
            raise ValueError(f"Settings.{name} has no description: the reference would leave "
                             f"{env_name(name)} unexplained; add Field(description=...)")
        text = type_text(field.annotation, field.metadata)
        desc = field.description.replace("|", "\\|")
        rows.append(f"| `{env_name(name)}` | {text} | {default_text(field.default)} | {desc} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Puts the table in the settings page; every other page passes unchanged."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its {MARKER} line: the settings table has no place")
    return markdown.replace(MARKER, render_table())
