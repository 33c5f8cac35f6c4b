"""MkDocs hook: lays out the sources as the installed ``tokenfleet`` package.

The repository keeps ``producer/``, ``shared/`` and ``workers/`` at its top level
and maps them to ``tokenfleet``, ``tokenfleet.shared`` and ``tokenfleet.workers``
only when it is packaged, a mapping mkdocstrings cannot follow. This hook builds
``build/api-src/tokenfleet`` out of links to those folders before the build, and
``mkdocs.yml`` points mkdocstrings there, so the API reference is read from the
working tree by the names users import.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def on_startup(**kwargs: Any) -> None:
    """Builds the linked package tree before any plugin looks for sources."""
    package = ROOT / "build" / "api-src" / "tokenfleet"
    shutil.rmtree(package, ignore_errors=True)
    package.mkdir(parents=True)
    for entry in (ROOT / "producer").iterdir():
        (package / entry.name).symlink_to(entry)
    for sub in ("shared", "workers"):
        (package / sub).symlink_to(ROOT / sub, target_is_directory=True)
