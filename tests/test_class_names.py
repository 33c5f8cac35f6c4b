"""Every public class of tokenfleet has a name of its own: two classes of one name in
different modules read alike at an import and in a traceback, and one is easily
imported for the other. A re-export is an import, not a class statement, so it counts
once. The modules are read, not imported (vLLM's and the GPU's need what a test
machine may lack)."""

from __future__ import annotations

import ast
from collections import defaultdict

from source_trees import ROOT, sources, tree

PACKAGES = {"producer": "tokenfleet", "shared": "tokenfleet.shared", "workers": "tokenfleet.workers"}

# Names that still collide, each to be renamed by its role; the test fails on any
# new one, and on one of these that no longer collides (strike it here).
KNOWN: set[str] = set()


def public_classes() -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for folder, package in PACKAGES.items():
        for path in sources(folder):
            module = ".".join([package, *path.relative_to(ROOT / folder).with_suffix("").parts])
            for node in tree(path).body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    where[node.name].append(module)
    return where


def test_no_two_public_classes_share_a_name() -> None:
    shared = {name: modules for name, modules in public_classes().items() if len(modules) > 1}
    new = {name: modules for name, modules in shared.items() if name not in KNOWN}
    assert not new, f"public classes of one name in several modules: {new}"
    gone = KNOWN - set(shared)
    assert not gone, f"no longer shared, strike from KNOWN: {sorted(gone)}"
