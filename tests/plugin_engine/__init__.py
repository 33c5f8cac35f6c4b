"""A third engine from outside tokenfleet, for the tests (``echo``): installed
by entry point alone, with the metadata ``install`` writes."""

from __future__ import annotations

import os
from pathlib import Path

NAME = "echo"
TESTS = Path(__file__).resolve().parent.parent


def install(root: Path, name: str = NAME, target: str = "plugin_engine.echo:build_echo",
            dist: str = "tokenfleet-echo-engine") -> str:
    """Write into ``root`` the metadata pip would install for a distribution
    ``dist`` that registers ``target`` as the engine ``name``; returns the
    PYTHONPATH on which Python finds that metadata and this package."""
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[tokenfleet.engines]\n{name} = {target}\n")
    return os.pathsep.join([str(root), str(TESTS)])
