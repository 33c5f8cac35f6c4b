"""The project's sources, parsed once while pytest collects the tests that read them.

CPython 3.11 keeps the AST constructor's recursion depth in state every thread shares
(gh-106905), and 3.11 parses in every thread that formats a traceback (for its carets).
A test that parses while an earlier test's gateway or worker thread logs an error can so
fail with "AST constructor recursion depth mismatch"; collection runs before any test
has started a thread."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("producer", "shared", "workers", "tests")

TREES: dict[Path, ast.Module] = {
    path: ast.parse(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    for folder in FOLDERS
    for path in sorted((ROOT / folder).rglob("*.py"))
}


def tree(path: Path) -> ast.Module:
    """The parsed module at `path` (absolute, or relative to the repository)."""
    return TREES[(ROOT / path).resolve()]


def sources(folder: str) -> list[Path]:
    """Every module under one of the repository's folders, in a stable order."""
    return [path for path in TREES if path.is_relative_to(ROOT / folder)]
