"""`tokenfleet bench --vs-vllm` drives the same openai-client load against vLLM's
own server and the fleet, and reports both sides' figures.

As for the rest of the benchmark, nothing here checks a speed. What a user reads
is checked on hand-made figures: every column for both servers and both loads,
the ratios, and how many greedy texts were vLLM's. The run end to end (vLLM's
server, a redis-server, a worker and the gateway, all started and stopped by the
command) costs minutes, most of them vLLM's server starting, so it runs only
when asked: ``TOKENFLEET_TEST_VS_VLLM=1``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tokenfleet.bench.vs_vllm import _same_text, judge, ratios, render_vs

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ("tokens", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
COLUMNS = ("conc", "load", "server", "tokens", "tokens/s", "TTFT p50", "TTFT p99", "ITL p50",
           "ITL p99", "/vLLM", "spread", "same text")


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenfleet.cli.app", "bench", *args],
                          cwd=ROOT, env={**os.environ, "COLUMNS": "160"}, capture_output=True,
                          text=True, timeout=timeout)


def figures(tokens_per_s: float, ttft_ms: float) -> dict[str, Any]:
    return {"jobs": 2, "tokens": 8, "tokens_per_s": tokens_per_s, "ttft_p50_ms": ttft_ms,
            "ttft_p99_ms": ttft_ms, "itl_p50_ms": 1.0, "itl_p99_ms": 2.0}


def test_the_report_shows_every_column_the_ratios_and_the_same_text_share() -> None:
    texts = {"vllm": {"2": ["a b", "c d"]}, "tokenfleet-hf": {"2": ["a b", "c e"]},
             "tokenfleet-vllm": {"2": ["a b", "c d"]}}
    results: dict[str, Any] = {
        "servers": {side: {"2": {"plain": figures(100.0 * k, 50.0 / k),
                                 "stream": figures(90.0 * k, 40.0 / k)}}
                    for side, k in (("vllm", 1), ("tokenfleet-hf", 2), ("tokenfleet-vllm", 1))},
        "same_text": _same_text(texts),
        "config": {"model": "tiny", "device": "cpu", "vllm_dtype": "float32",
                   "max_new_tokens": 4, "repeat": 1},
    }
    assert results["same_text"] == {"tokenfleet-hf": {"2": 0.5}, "tokenfleet-vllm": {"2": 1.0}}
    results["ratios"] = ratios(results)
    assert results["ratios"]["tokenfleet-hf"]["2"]["plain"] == {
        "tokens_per_s": 2.0, "tokens_per_s_spread": None, "added_ttft_p50_ms": -25.0,
        "ttft_p50": 0.5}
    results["targets"] = judge(results)  # the targets are the vLLM engine's
    assert {t["target"] for t in results["targets"]} == {
        "plain tokens/s / vLLM serve at 2", "streaming tokens/s / vLLM serve at 2",
        "streaming TTFT p50 over vLLM serve at 2 (ms)"}
    console = Console(record=True, width=200)
    render_vs(results, console)
    shown = console.export_text()
    for column in COLUMNS:
        assert column in shown, column
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in shown.splitlines()
            if "│ plain " in line and "serve at" not in line]
    assert [(row[2], row[-1]) for row in rows] == [
        ("vLLM serve", "-"), ("tokenfleet-hf", "0.50"), ("tokenfleet-vllm", "1.00")]


def test_the_ratio_is_the_median_of_the_rounds_and_its_spread_is_shown() -> None:
    """Rounds of 1.3, 0.8 and 0.95: the median, 0.95, not the best round's
    flattering 1.3 (nor the ratio of each side's best round)."""
    vllm = {"2": {"plain": figures(100.0, 10.0), "stream": figures(100.0, 10.0)}}
    fleet = {"2": {load: {**figures(130.0, 10.0), "round_ratios": [1.3, 0.8, 0.95]}
                   for load in ("plain", "stream")}}
    results: dict[str, Any] = {
        "servers": {"vllm": vllm, "tokenfleet-hf": fleet},
        "same_text": {"tokenfleet-hf": {"2": 1.0}},
        "config": {"model": "tiny", "device": "cpu", "vllm_dtype": "float32",
                   "max_new_tokens": 4, "repeat": 3}}
    results["ratios"] = ratios(results)
    plain = results["ratios"]["tokenfleet-hf"]["2"]["plain"]
    assert plain["tokens_per_s"] == 0.95 and plain["tokens_per_s_spread"] == [0.8, 1.3]
    results["targets"] = judge(results)
    console = Console(record=True, width=200)
    render_vs(results, console)
    shown = console.export_text()
    assert "0.80-1.30" in shown and "the median of 3 round(s)" in shown


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.skipif(os.environ.get("TOKENFLEET_TEST_VS_VLLM") != "1",
                    reason="minutes of vLLM's server starting: TOKENFLEET_TEST_VS_VLLM=1 runs it")
@pytest.mark.timeout(600)
def test_vs_vllm_runs_both_servers_end_to_end_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "vs.json"
    result = bench("--vs-vllm", "--model", "tiny", "--engines", "hf", "--concurrency", "2",
                   "--max-new-tokens", "4", "--repeat", "2", "--round-s", "1", "--json", str(out),
                   timeout=580)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())

    servers = report["servers"]
    assert set(servers) == {"vllm", "tokenfleet-hf"}
    for side in servers:
        for load in ("plain", "stream"):
            got = servers[side]["2"][load]
            assert set(FIGURES) <= set(got), (side, load)
            requests = got["requests_per_round"]  # whole waves of 2, a second's worth
            assert requests % 2 == 0 and got["jobs"] == requests, (side, load)
            assert 0 < got["tokens"] <= requests * 4 and len(got["runs"]) == 2, (side, load)
            if side != "vllm":
                assert len(got["round_ratios"]) == 2, (side, load)
        assert servers[side]["2"]["stream"]["itl_p50_ms"] is not None, side
    assert set(report["ratios"]["tokenfleet-hf"]["2"]) == {"plain", "stream"}
    assert report["same_text"]["tokenfleet-hf"]["2"] in (0.0, 0.5, 1.0)  # of 2 requests
    assert report["config"]["vllm"] and report["config"]["model_dir"].endswith("tiny_model")
    for column in COLUMNS:
        assert column in result.stdout, column
    assert "vLLM serve" in result.stdout and "tokenfleet-hf" in result.stdout


def test_vs_vllm_refuses_the_options_of_the_other_modes() -> None:
    result = bench("--vs-vllm", "--jobs", "8", "--modes", "fleet", timeout=60)
    assert result.returncode == 2
    assert "--vs-vllm does not take --jobs, --modes" in result.stderr


def test_engines_go_with_vs_vllm_only() -> None:
    result = bench("--engines", "vllm", timeout=60)
    assert result.returncode == 2
    assert "--engines goes with --vs-vllm" in result.stderr
