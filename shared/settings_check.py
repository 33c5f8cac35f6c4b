"""What the environment gave the settings, said in one line: a value a setting
does not take (naming the variable and what it takes), and ``TOKENFLEET_*``
variables that are no setting at all (with the closest name)."""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from tokenfleet.shared.settings import Settings

# Variables with the prefix that are not settings: the test suite's own switches.
NOT_SETTINGS_PREFIX = "TOKENFLEET_TEST_"

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
    """A type as a reader of the environment sees it: ``int (≥ 1)``, ``"rect" or "paged"``."""
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


def accepted(field: str) -> str:
    """What the setting ``field`` takes, e.g. ``int (≥ 1, ≤ 4096) or "auto"``."""
    info = Settings.model_fields[field]
    return type_text(info.annotation, info.metadata)


def describe(exc: ValidationError) -> str:
    """The settings' validation error as one line: each bad variable, its value
    and what it takes (a union's branches give one error each: one line for all)."""
    said: dict[str, str] = {}
    for error in exc.errors():
        loc = error.get("loc") or ()
        field = str(loc[0]) if loc else ""
        if field not in Settings.model_fields or field in said:
            continue
        value = error.get("input")
        shown = repr(value) if isinstance(value, str | int | float) else "its value"
        if error.get("type") == "value_error" and value == "":  # unset: a default derived
            said[field] = error["msg"].removeprefix("Value error, ")
        elif error.get("type") == "value_error":  # a validator's own sentence
            said[field] = f"{env_name(field)}={shown}: {error['msg'].removeprefix('Value error, ')}"
        else:
            said[field] = f"{env_name(field)}={shown} is not valid: it takes {accepted(field)}"
    return "; ".join(said.values()) or str(exc).splitlines()[0]


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One warning per ``TOKENFLEET_*`` variable that sets nothing, with the
    closest setting's name, so a misspelt setting is not silently ignored."""
    known = [env_name(f) for f in Settings.model_fields]
    prefix = env_name("")
    warnings = []
    for name in sorted(environ):
        if not name.startswith(prefix) or name in known or name.startswith(NOT_SETTINGS_PREFIX):
            continue
        # A name cut short (MAX_NEW_TOKENS for MAX_NEW_TOKENS_LIMIT) before a look-alike.
        close = ([k for k in known if k.startswith(name)]
                 or difflib.get_close_matches(name, known, n=1, cutoff=0.6))
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.append(f"{name} is not a setting{hint}; it is ignored")
    return warnings
