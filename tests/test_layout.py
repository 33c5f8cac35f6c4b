"""The house's rules, read off the source: which room may import which, that
only the gateway speaks HTTP, and that no runtime module imports itself round
a circle.

Imports run one way: wire (``tokenfleet.shared``) ← client ← openai ← gateway
and batches; wire ← worker. The command line and the bench stand on top and may
import anything; nothing imports them. A module-level import counts, and so does
one inside a function (a lazy import does not make a circle acceptable), except
under ``if TYPE_CHECKING:``, which never runs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from source_trees import tree

ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's source lies in the checkout (pyproject.toml's package-dir).
SOURCES = {"tokenfleet": ROOT / "producer", "tokenfleet.shared": ROOT / "shared",
           "tokenfleet.workers": ROOT / "workers"}

# Each room and the rooms it may import (besides itself and third-party packages).
WIRE = {"shared"}
MAY_IMPORT: dict[str, set[str]] = {
    "shared": WIRE,
    "workers": WIRE,
    "files": WIRE,
    "client": WIRE | {"files"},
    "webhooks": WIRE,
    "exporter": WIRE | {"client"},
    "openai": WIRE | {"client"},
    "batches": WIRE | {"client", "files", "openai", "webhooks"},
    "gateway": WIRE | {"client", "files", "openai", "batches", "webhooks"},
    "top": WIRE | {"client"},  # tokenfleet/__init__.py: the public API, re-exported
}
ON_TOP = {"cli", "bench"}  # may import any room; no room imports them
# The crossings not yet undone, each named. A crossing fixed must leave this
# list, so it shrinks.
KNOWN_CROSSINGS: set[tuple[str, str]] = set()
HTTP = ("fastapi", "starlette")


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, source in SOURCES.items():
        for path in source.rglob("*.py"):
            if any(part in ("shared", "workers") for part in path.relative_to(source).parts[:-1]) \
                    and package == "tokenfleet":
                continue  # not the producer's: they are packages of their own
            if package == "tokenfleet" and path.relative_to(source).parts[0] in ("shared", "workers"):
                continue
            rel = path.relative_to(source).with_suffix("").parts
            name = ".".join((package, *rel))
            found[name.removesuffix(".__init__")] = path
    return found


def room(module: str) -> str:
    parts = module.split(".")
    if parts[:2] == ["tokenfleet", "shared"]:
        return "shared"
    if parts[:2] == ["tokenfleet", "workers"]:
        return "workers"
    if len(parts) > 2 or (len(parts) == 2 and (SOURCES["tokenfleet"] / parts[1]).is_dir()):
        return parts[1]
    return "top"


def imports(path: Path, *, lazy: bool = True) -> Iterator[tuple[str, int]]:
    """Every module ``path`` imports, with its line, TYPE_CHECKING blocks left out;
    ``lazy``: those imported inside functions too."""
    def walk(nodes: list[ast.stmt]) -> Iterator[tuple[str, int]]:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from walk(node.orelse)
                continue
            if isinstance(node, ast.Import):
                yield from ((alias.name, node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield node.module, node.lineno
                yield from ((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)
            if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    yield from walk([child])
    yield from walk(tree(path).body)


MODULES = modules()


def test_the_layout_is_read_whole() -> None:
    rooms = {room(m) for m in MODULES}
    assert {"shared", "workers", "client", "openai", "gateway", "batches", "cli", "bench"} <= rooms
    assert rooms <= set(MAY_IMPORT) | ON_TOP, f"a room with no rule: {rooms - set(MAY_IMPORT) - ON_TOP}"


def test_imports_run_one_way() -> None:
    wrong, known = [], set()
    for module, path in sorted(MODULES.items()):
        here = room(module)
        for name, line in imports(path):
            if name not in MODULES or room(name) == here:
                continue
            if (module, name) in KNOWN_CROSSINGS:
                known.add((module, name))
                continue
            there = room(name)
            if there in ON_TOP and here not in ON_TOP:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} (the {there} stands on top)")
            elif here not in ON_TOP and there not in MAY_IMPORT[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({here} -> {there})")
    assert not wrong, "\n".join(wrong)
    assert known == KNOWN_CROSSINGS, f"fixed, so off the list: {KNOWN_CROSSINGS - known}"


def test_only_the_gateway_speaks_http() -> None:
    # A refusal is an OpenAIError value; gateway.error_response alone makes it HTTP.
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for module, path in sorted(MODULES.items()) if room(module) != "gateway"
             for name, line in imports(path) if name.split(".")[0] in HTTP]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = {m: {name for name, _ in imports(p, lazy=False) if name in MODULES and name != m}
             for m, p in MODULES.items()}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first; a package's
    # __init__ that imports its own modules is therefore no circle of its own.
    circles = strongly_connected(graph)
    assert not circles, "\n".join(" -> ".join(sorted(c)) for c in circles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively: the groups of two or more modules that reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        out.append(group)
    return out


@pytest.mark.parametrize("graph, circles", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [{"a", "b"}]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_circle_finder_finds_circles(graph: dict[str, set[str]], circles: list[set[str]]) -> None:
    assert strongly_connected(graph) == circles
