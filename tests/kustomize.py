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


def render(overlay: str, root: Path = KUBE) -> list[Obj]:
    """The overlay's objects; the test is skipped where kubectl is missing."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: it renders the overlays (kubectl kustomize)")
    result = subprocess.run([kubectl, "kustomize", str(root / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [o for o in yaml.safe_load_all(result.stdout) if o]


def render_with_prometheus(overlay: str, workdir: Path) -> list[Obj]:
    """The overlay with the two Prometheus components added the way
    docs/deploy.md tells an operator to: metrics-exporter in the overlay,
    prometheus-scaler in the queue `default`, on a copy of deploy/kubernetes."""
    root = workdir / "kubernetes"
    shutil.copytree(KUBE, root)
    _add_component(root / "overlays" / overlay, "../../components/metrics-exporter")
    _add_component(root / "base" / "queues" / "default", "../../../components/prometheus-scaler")
    return render(overlay, root)


def _add_component(folder: Path, component: str) -> None:
    path = folder / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    kustomization["components"] = [*kustomization.get("components", []), component]
    path.write_text(yaml.safe_dump(kustomization, sort_keys=False))


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"no single {kind} {name}"
    return found[0]


def env_of(container: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}
