"""A worker serves its model under the model's name unless told another, as
vLLM does (``--served-model-name``): ``--model tiny`` serves ``model="tiny"``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_queue_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENFLEET_QUEUE", raising=False)
    monkeypatch.delenv("TOKENFLEET_MODEL", raising=False)


@pytest.mark.parametrize(("model", "queue"), [
    ("tiny", "tiny"),
    ("llama-86m", "llama-86m"),
    ("/models/llama-3-8b-instruct", "llama-3-8b-instruct"),
    ("/models/llama-3-8b-instruct/", "llama-3-8b-instruct"),
    ("hf:Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B-Instruct"),
])
def test_the_queue_is_the_models_name_unless_named(model: str, queue: str) -> None:
    assert Settings(model=model).queue == queue


def test_a_named_queue_wins_over_the_models_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(model="tiny", queue="chat").queue == "chat"
    monkeypatch.setenv("TOKENFLEET_MODEL", "/models/llama")
    assert Settings().queue == "llama"
    monkeypatch.setenv("TOKENFLEET_QUEUE", "default")  # a fleet that kept the old name
    assert Settings().queue == "default"


def tokenfleet(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("TOKENFLEET_QUEUE", "TOKENFLEET_MODEL")}
    return subprocess.run([sys.executable, "-m", "tokenfleet.cli.app", *args], cwd=ROOT,
                          env={**clean, "TOKENFLEET_REDIS_URL": "redis://127.0.0.1:1/0", **env},
                          capture_output=True, text=True, timeout=60)


def test_a_model_whose_name_is_no_queue_name_is_one_line_asking_for_queue(
        tmp_path: Path) -> None:
    out = tokenfleet("worker", "--gpus", "none", "--model", str(tmp_path / "my model"))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "'my model'" in lines[0] and "--queue NAME" in lines[0], lines


def test_served_model_name_is_another_name_for_queue() -> None:
    """vLLM's flag names the queue: a bad name is refused as the queue's."""
    out = tokenfleet("worker", "--gpus", "none", "--model", "tiny", "--served-model-name", "a b")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "TOKENFLEET_QUEUE='a b'" in lines[0], lines


def test_submit_without_a_model_takes_the_one_served_queue_and_asks_among_several(
        settings: Any, r: Any) -> None:
    from gateway_server import pin_live_worker

    env = {"TOKENFLEET_REDIS_URL": settings.redis_url, "TOKENFLEET_NAMESPACE": settings.namespace}
    pin_live_worker(r, settings.namespace, "tiny")
    one = tokenfleet("submit", "Hi", "--max-new-tokens", "2", **env)
    assert one.returncode == 0 and one.stdout.startswith("tiny:"), one.stderr
    pin_live_worker(r, settings.namespace, "other", name="idle2@test")
    two = tokenfleet("submit", "Hi", "--max-new-tokens", "2", **env)
    lines = two.stderr.strip().splitlines()
    assert two.returncode == 3 and len(lines) == 1, two.stderr
    assert "(other, tiny)" in lines[0] and "--model NAME" in lines[0], lines
