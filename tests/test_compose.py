"""compose.yaml describes a fleet the CLI can actually run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import click
import pytest
import yaml

from tests.dockerfile import stages
from tokenfleet.shared.settings import Settings
from tokenfleet.cli.app import main

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"worker": "worker-cpu", "gateway": "gateway", "flower": "flower"}


@pytest.fixture(scope="module")
def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "compose.yaml").read_text())  # type: ignore[no-any-return]


def argv(service: dict) -> list[str]:  # type: ignore[type-arg]
    """What the service's container runs: its image's entry point, then the command."""
    stage = stages()[service["build"]["target"]]
    return stage.exec_form("ENTRYPOINT") + service["command"]  # type: ignore[no-any-return]


def options_of(command: str) -> set[str]:
    cmd = main.commands[command]  # type: ignore[attr-defined]
    return {opt for p in cmd.params if isinstance(p, click.Option) for opt in p.opts}


def test_services_are_redis_workers_gateway_and_flower(compose: dict) -> None:  # type: ignore[type-arg]
    assert set(compose["services"]) == {"redis", "worker", "gateway", "flower"}
    assert "--appendonly" in compose["services"]["redis"]["command"]
    for name in ("worker", "gateway", "flower"):
        service = compose["services"][name]
        url = service["environment"]["TOKENFLEET_REDIS_URL"]
        assert url.startswith("redis://:${REDIS_PASSWORD") and url.endswith("@redis:6379/0")
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("service", ["worker", "gateway"])
def test_tokenfleet_commands_use_real_cli_options(compose: dict, service: str) -> None:  # type: ignore[type-arg]
    command = argv(compose["services"][service])
    assert command[0] == "tokenfleet" and command[1] in main.commands  # type: ignore[attr-defined]
    used = {arg for arg in command[2:] if arg.startswith("--")}
    assert used <= options_of(command[1]), used - options_of(command[1])


def test_redis_and_flower_are_not_open_to_the_world(compose: dict) -> None:  # type: ignore[type-arg]
    redis = compose["services"]["redis"]
    assert "ports" not in redis
    assert "--requirepass" in redis["command"]
    flower = compose["services"]["flower"]
    assert any(arg.startswith("--basic-auth=") for arg in flower["command"])
    assert all(port.startswith("127.0.0.1:") for port in flower["ports"])


def test_flower_runs_against_the_celery_app(compose: dict) -> None:  # type: ignore[type-arg]
    command = argv(compose["services"]["flower"])
    assert command[:4] == ["celery", "-A", "tokenfleet.workers.app", "flower"]


@pytest.mark.parametrize("service", TARGETS)
def test_each_service_builds_its_own_target_of_the_dockerfile(
        compose: dict, service: str) -> None:  # type: ignore[type-arg]
    build = compose["services"][service]["build"]
    assert build == {"context": ".", "target": TARGETS[service]}
    assert TARGETS[service] in stages()


def test_workers_read_models_from_a_volume_and_outlast_the_drain(
        compose: dict) -> None:  # type: ignore[type-arg]
    worker = compose["services"]["worker"]
    assert "models:/models" in worker["volumes"] and "models" in compose["volumes"]
    grace = int(worker["stop_grace_period"].removesuffix("s"))
    assert grace > Settings.model_fields["drain_grace_s"].default


def test_docker_compose_accepts_the_file_where_it_is_installed() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True,
                                        timeout=30).returncode != 0:
        pytest.skip("no docker compose here: the structural checks above stand in for it")
    result = subprocess.run([docker, "compose", "-f", str(ROOT / "compose.yaml"), "config", "-q"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
