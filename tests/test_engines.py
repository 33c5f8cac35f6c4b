"""Engines by name: any engine registered under the ``tokenfleet.engines``
entry points is found by its name, and a name none registers is refused with
the names that are installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenfleet.shared.settings import Settings
from tokenfleet.workers import engines

from plugin_engine import NAME, TESTS, install

ROOT = TESTS.parent


def test_tokenfleet_registers_its_own_engines_by_entry_point() -> None:
    from tokenfleet.workers.build import build_hf
    from tokenfleet.bench.gpu_sim import build_gpu_sim
    from tokenfleet.workers.vllm_engine import build_vllm

    assert set(engines.BUILT_IN) <= set(engines.names())
    assert engines.factory("hf") is build_hf
    assert engines.factory("vllm") is build_vllm
    assert engines.factory("gpu-sim") is build_gpu_sim


def test_an_installed_distribution_adds_an_engine_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from plugin_engine.echo import build_echo

    assert NAME in engines.names()
    assert engines.factory(NAME) is build_echo


def test_an_unknown_engine_is_refused_with_the_installed_names_when_the_worker_is_built() -> None:
    from tokenfleet.workers.build import build_engine

    settings = Settings(engine="nope")  # settings take any name: no engine is loaded for them
    with pytest.raises(engines.UnknownEngine) as refused:
        build_engine(settings)
    message = str(refused.value)
    assert "no engine named 'nope'" in message and "hf, vllm" in message


def test_two_distributions_that_register_one_name_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install(tmp_path / "a")
    install(tmp_path / "b", target="plugin_engine.other:build", dist="another-echo")
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    with pytest.raises(engines.UnknownEngine, match="registered more than once: .*another-echo"):
        engines.factory(NAME)


def cli(*args: str, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    """``tokenfleet ARGS`` with only ``pythonpath``'s distributions added."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "tokenfleet.cli.app", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)


def test_the_worker_command_takes_any_installed_engine_and_lists_them(tmp_path: Path) -> None:
    shown = cli("worker", "--help", pythonpath=install(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert "[echo|gpu-sim|hf|vllm]" in " ".join(shown.stdout.split())

    refused = cli("worker", "--engine", "nope", "--gpus", "none")
    assert refused.returncode == 2
    assert "'nope' is not one of 'gpu-sim', 'hf', 'vllm'" in refused.stderr
