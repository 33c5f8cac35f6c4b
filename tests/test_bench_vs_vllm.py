"""`tokenfleet bench --vs-vllm` drives the same openai-client load against vLLM's
own server and the fleet, and reports both sides' figures.

As for the rest of the benchmark, nothing here checks a speed: only that the
comparison runs end to end (vLLM's server, a redis-server, a worker and the
gateway, all started and stopped by the command) and that its JSON carries the
figures of both sides.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("tokens", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenfleet.workers.cli", "bench", *args],
                          cwd=ROOT, env={**os.environ, "COLUMNS": "160"}, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.timeout(600)
def test_vs_vllm_reports_both_servers_plain_and_streamed(tmp_path: Path) -> None:
    out = tmp_path / "vs.json"
    result = bench("--vs-vllm", "--model", "tiny", "--engines", "hf", "--concurrency", "4",
                   "--max-new-tokens", "8", "--json", str(out), timeout=580)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())

    servers = report["servers"]
    assert set(servers) == {"vllm", "tokenfleet-hf"}
    for side in servers:
        for load in ("plain", "stream"):
            figures = servers[side]["4"][load]
            assert set(FIGURES) <= set(figures), (side, load)
            assert figures["jobs"] == 4 and 0 < figures["tokens"] <= 4 * 8, (side, load)
            assert figures["tokens_per_s"] > 0 and figures["ttft_p50_ms"] > 0, (side, load)
        assert servers[side]["4"]["stream"]["itl_p50_ms"] is not None, side
    ratios = report["ratios"]["tokenfleet-hf"]["4"]
    assert ratios["plain"]["tokens_per_s"] > 0 and ratios["stream"]["tokens_per_s"] > 0
    assert 0.0 <= report["same_text"]["tokenfleet-hf"]["4"] <= 1.0
    assert report["config"]["vllm"] and report["config"]["model_dir"].endswith("tiny_model")
    assert "vLLM serve" in result.stdout and "tokenfleet-hf" in result.stdout


def test_vs_vllm_refuses_the_options_of_the_other_modes() -> None:
    result = bench("--vs-vllm", "--jobs", "8", "--modes", "fleet", timeout=60)
    assert result.returncode == 2
    assert "--vs-vllm does not take --jobs, --modes" in result.stderr


def test_engines_go_with_vs_vllm_only() -> None:
    result = bench("--engines", "vllm", timeout=60)
    assert result.returncode == 2
    assert "--engines goes with --vs-vllm" in result.stderr
