"""A queue's stream keys are composed in one place: ``QueueTopology`` (and the
``Keys``/``level_queue`` primitives under it). A module that spelled a stream
name itself would miss the partitions or tenants added later, as the
hand-written KEDA triggers once did."""

from __future__ import annotations

import ast
from pathlib import Path

from tokenfleet.shared.wire.keys import Keys, model_streams
from tokenfleet.shared.wire.topology import QueueTopology

from source_trees import sources, tree

ROOT = Path(__file__).resolve().parent.parent
# The modules allowed to compose a queue's stream keys.
ALLOWED = {"shared/wire/keys.py", "shared/wire/topology.py"}


def _composes_a_stream(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "model_streams":
            return True
        # keys.queue(level_queue(...)) or keys.queue(f"..."): a level's name made here.
        if name == "queue" and node.args and (
                isinstance(node.args[0], ast.JoinedStr)
                or (isinstance(node.args[0], ast.Call)
                    and getattr(node.args[0].func, "id", "") == "level_queue")):
            return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return ":q:" in node.value
    return False


def test_no_module_outside_the_topology_composes_a_stream_name() -> None:
    offenders = []
    for folder in ("producer", "workers", "shared"):
        for path in sources(folder):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            for node in ast.walk(tree(path)):
                if _composes_a_stream(node):
                    offenders.append(f"{rel}:{getattr(node, 'lineno', '?')}")
    assert offenders == [], offenders


def test_the_walk_sees_a_stream_composed_by_hand() -> None:
    tree = ast.parse('keys.queue(level_queue(q, "high", t))\nf"{ns}:q:{{{q}}}"')
    assert any(_composes_a_stream(n) for n in ast.walk(tree))
    assert _composes_a_stream(ast.Constant(":q:"))


def test_a_partitioned_queue_with_tenants_has_every_stream_once() -> None:
    keys = Keys("ns")
    topology = QueueTopology(keys, "m", 3, ("acme", "default", "acme", "beta"))
    assert topology.tenants == ("acme", "beta")
    streams = topology.streams()
    assert len(set(streams)) == len(streams) == 3 * 4 * 3
    assert streams[:3] == ["ns:q:{m#0}:high", "ns:q:{m#0}:high:acme", "ns:q:{m#0}:high:beta"]
    assert topology.streams("m#2")[-1] == "ns:q:{m#2}:batch:beta"
    # One partition: the names a queue always had, in submit.lua's order.
    assert QueueTopology(keys, "m", 1, ("acme",)).streams() == model_streams(keys, "m", ["acme"])
    assert model_streams(keys, "m", []) == [
        "ns:q:{m}:high", "ns:q:{m}", "ns:q:{m}:low", "ns:q:{m}:batch"]
