"""deploy/kubernetes as the tests read it: an overlay rendered by `kubectl kustomize`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

KUBE = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"

Obj = dict[str, Any]


def render(overlay: str) -> list[Obj]:
    """The overlay's objects; the test is skipped where kubectl is missing."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: it renders the overlays (kubectl kustomize)")
    result = subprocess.run([kubectl, "kustomize", str(KUBE / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"no single {kind} {name}"
    return found[0]


def env_of(container: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}
