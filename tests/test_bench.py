"""`tokenfleet bench` runs every mode on a tiny setting and reports every figure.

A benchmark is not a timed test: nothing here checks a speed, only that the
command runs end to end (a redis-server of its own, Celery workers, the naive
Celery app) and that its JSON carries every field a reader relies on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenfleet.bench.redis_cost import RedisSample, cost
from tokenfleet.bench.report import judge, ratios
from tokenfleet.bench.workload import (
    FIELDS,
    conversations,
    Trace,
    describe,
    make_jobs,
    percentile,
    shared_prefix,
    summarize,
)

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    """``tokenfleet bench`` with ``args``, in a process of its own; it must succeed."""
    result = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli.app", "bench", *args],
        cwd=ROOT, env={**os.environ, "COLUMNS": "160"}, capture_output=True, text=True,
        timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_runs_every_mode_and_writes_every_field(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = bench("--jobs", "6", "--concurrency", "2", "--max-new-tokens", "4",
                   "--probe-jobs", "3", "--overhead-jobs", "40", "--json", str(out),
                   "--plot", str(png))
    report = json.loads(out.read_text())

    for mode in ("direct", "fleet", "overhead"):
        assert set(FIELDS) <= set(report[mode]["2"]), mode
    assert set(FIELDS) <= set(report["naive"])
    for mode in ("direct", "fleet"):
        assert set(FIELDS) <= set(report["low_load"][mode])
    # Greedy decoding of the same jobs: the fleet and the naive pattern make
    # exactly the tokens the model makes in-process.
    direct, fleet = report["direct"]["2"], report["fleet"]["2"]
    assert direct["jobs"] == fleet["jobs"] == report["naive"]["jobs"] == 6
    assert direct["tokens"] == fleet["tokens"] == report["naive"]["tokens"] > 0
    assert fleet["tokens_per_s"] > 0 and fleet["ttft_p50_ms"] is not None
    assert report["overhead"]["2"]["tokens"] == sum(j.max_new_tokens for j in make_jobs(6, 4))

    assert set(report["ratios"]) >= {"fleet_vs_direct", "fleet_vs_naive", "added_ttft_ms",
                                     "overhead_vs_celery_noop"}
    assert report["ratios"]["fleet_vs_direct"]["2"] > 0
    costs = report["overhead_costs"]
    for key in ("fleet_null_jobs_per_s", "celery_noop_jobs_per_s", "publish_us_per_token",
                "fleet_worker_cpu_us_per_token", "fleet_redis_cpu_us_per_token"):
        assert key in costs, key
    assert {t["target"] for t in report["targets"]} >= {
        "overhead runner / Celery no-op, jobs/s, full queue",
        "added TTFT over direct, p50, low load (ms)",
        "tiny model load + first token, cold, CPU (s)"}
    assert report["cold_start"]["load_and_first_token_s"] > 0
    assert "model load + first token" in result.stdout
    assert report["config"]["torch_threads"] >= 1
    assert "tokens/s" in result.stdout and "targets" in result.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
    for mode in ("fleet", "overhead"):  # what Redis did for each generated token
        figures = report[mode]["2"]
        assert figures["redis_commands"] > 0 and figures["redis_commands_per_token"] > 0
        assert "evalsha" in figures["redis_commands_per_token_by_name"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_absorb_sweeps_workers_against_one_redis(tmp_path: Path) -> None:
    out = tmp_path / "absorb.json"
    result = bench("--modes", "absorb", "--concurrency", "4", "--absorb-workers", "1,2",
                   "--absorb-tokens", "400", "--json", str(out))
    sweep = json.loads(out.read_text())["absorb"]
    assert [(r["batch"], r["workers"]) for r in sweep["rows"]][:1] == [(4, 1)]
    for row in sweep["rows"]:
        assert row["tokens"] >= 400 and row["tokens_per_s"] > 0
        assert row["redis_commands_per_token"] > 0 and row["tokens_per_redis_cpu_s"] > 0
    assert sweep["peak_tokens_per_s"] == max(r["tokens_per_s"] for r in sweep["rows"])
    assert "one Redis absorbing tokens" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_prefix_mode_compares_the_caches_on_the_same_jobs(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    result = bench("--modes", "prefix", "--workload", "shared-prefix", "--jobs", "24",
                   "--concurrency", "8", "--max-new-tokens", "4", "--json", str(out))
    at = json.loads(out.read_text())["prefix"]["8"]
    prompts = sum(len(j.prompt) for j in make_jobs(24, 4, workload="shared-prefix"))
    paged, prefix = at["paged"], at["prefix"]
    # Without the cache every prompt token is computed, about one a character
    # over five (the tiny tokenizer's words); with it, the system prompts that
    # came before are found: 24 jobs of 16 prompts repeat some.
    assert paged["prefill_tokens"] == at["rect"]["prefill_tokens"] > prompts / 6
    assert paged["prefix_hit_tokens"] == 0 and prefix["prefix_hit_tokens"] > 0
    assert prefix["prefill_tokens"] + prefix["prefix_hit_tokens"] == paged["prefill_tokens"]
    # Greedy decoding: the cache changes no output.
    assert at["outputs_compared"] == 24 and at["outputs_differing"] == {"paged": 0, "rect": 0}
    assert 0 < at["ratios"]["prefill_tokens_vs_paged"] < 1
    assert at["ratios"]["prefill_tokens_vs_paged_cold"] == at["ratios"]["prefill_tokens_vs_paged"]
    assert at["ratios"]["prefill_tokens_vs_paged_warm"] is None  # one round: none after it
    assert "prefix vs paged" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_placement_mode_runs_two_fleets_on_shared_and_hot_prefixes(tmp_path: Path) -> None:
    out = tmp_path / "placement.json"
    result = bench("--modes", "placement", "--jobs", "32", "--concurrency", "8",
                   "--max-new-tokens", "4", "--rate", "200", "--json", str(out))
    at = json.loads(out.read_text())["placement"]["8"]
    assert at["rate"] == 200  # the shared and hot loads' jobs arrive over time
    for load in ("shared", "hot"):
        scatter, placed = at[load]["scatter"], at[load]["placed"]
        # Scattered, no job waits in a worker's own stream; placed, the jobs of the
        # prefixes the warm-up ran go to the workers that hold them.
        assert scatter["placed_jobs"] == 0 and placed["placed_jobs"] > 0
        for fleet in (scatter, placed):
            assert 0 < fleet["hit_rate"] <= 1 and fleet["tokens_per_s"] > 0
            assert sum(fleet["tokens_by_worker"].values()) == 32 * 4
    # A conversation's next turn finds its last one cached only where that ran.
    talks = at["conversations"]
    assert talks["scatter"]["placed_jobs"] == 0 and talks["placed"]["placed_jobs"] > 0
    assert talks["scatter"]["hit_rate"] < talks["placed"]["hit_rate"] <= talks["ceiling"] < 1
    assert "placement by prefix, 2 workers, batch 8, 32 jobs arriving at 200 a second" in (
        result.stdout)


def test_conversations_grow_turn_by_turn() -> None:
    talks = conversations(8, 4, 16, seed=5)
    assert [len(turn) for turn in talks] == [8] * 4
    for before, after in zip(talks, talks[1:]):
        for a, b in zip(before, after):
            assert b.prompt.startswith(a.prompt + "\nassistant: ") and "\nuser: " in b.prompt[
                len(a.prompt):]
    assert len({turn[0].prompt[:200] for turn in talks}) == 1  # one context per conversation
    assert len({job.prompt[:200] for job in talks[0]}) == 8


def test_a_hot_prefix_load_gives_most_jobs_one_system_prompt() -> None:
    jobs = shared_prefix(1000, 8, seed=3, system_seed=0, hot=0.8)
    systems = [j.prompt.split("\nuser: ")[0] for j in jobs]
    first = shared_prefix(1, 8, seed=0, system_seed=0, hot=1.0)[0].prompt.split("\nuser: ")[0]
    assert 0.8 < systems.count(first) / len(jobs) < 0.86  # 80%, and a 16th of the rest


def test_the_shared_prefix_workload_repeats_a_few_long_system_prompts() -> None:
    jobs = make_jobs(256, 64, workload="shared-prefix")
    assert jobs == make_jobs(256, 64, workload="shared-prefix")
    systems = {j.prompt.split("\nuser: ")[0] for j in jobs}
    assert len(systems) == 16 and {len(s.split()) for s in systems} == {480}
    assert len({j.prompt for j in jobs}) == 256 and {j.max_new_tokens for j in jobs} == {64}
    # Another seed, other system prompts; unless they are named: other user turns only.
    assert not systems & {j.prompt.split("\nuser: ")[0]
                          for j in make_jobs(256, 64, workload="shared-prefix", seed=1)}
    again = shared_prefix(256, 64, seed=1, system_seed=0)
    assert {j.prompt.split("\nuser: ")[0] for j in again} == systems
    assert not {j.prompt for j in again} & {j.prompt for j in jobs}


def test_redis_cost_is_the_counters_difference_per_token_less_its_own_info_calls() -> None:
    before = RedisSample({"evalsha": 10, "xadd": 100, "info": 7}, cpu_s=1.0, at=0.0)
    after = RedisSample({"evalsha": 20, "xadd": 140, "publish": 40, "info": 9}, cpu_s=1.5,
                        at=2.0)
    figures = cost(before, after, tokens=400)
    assert figures["redis_commands"] == 90
    assert figures["redis_commands_per_token"] == pytest.approx(0.225)
    assert figures["redis_cpu_s_per_1k_tokens"] == pytest.approx(1.25)
    assert list(figures["redis_commands_per_token_by_name"]) == ["xadd", "publish", "evalsha"]


def test_every_mode_gets_the_same_jobs_and_arrival_times() -> None:
    assert make_jobs(20, 32) == make_jobs(20, 32)
    jobs = make_jobs(20, 32, rate=10.0)
    assert [j.arrival_s for j in jobs[:3]] == [0.0, 0.1, 0.2]
    assert all(16 <= j.max_new_tokens <= 32 for j in jobs)


def test_the_mixed_workload_has_long_tailed_lengths_the_same_every_run() -> None:
    jobs = make_jobs(1000, 256, workload="mixed")
    assert jobs == make_jobs(1000, 256, workload="mixed")
    lengths = describe(jobs)
    # most jobs short, a tail of long ones, none past the limits
    assert 40 <= lengths["max_new_tokens"]["p50"] <= 90 and lengths["max_new_tokens"]["max"] == 256
    assert lengths["max_new_tokens"]["p99"] >= 3 * lengths["max_new_tokens"]["p50"]
    assert 10 <= lengths["prompt_words"]["p50"] <= 24 and lengths["prompt_words"]["max"] == 96
    assert lengths["prompt_words"]["p99"] >= 4 * lengths["prompt_words"]["p50"]
    with pytest.raises(ValueError, match="unknown workload"):
        make_jobs(1, 4, workload="bursty")


def test_figures_come_from_the_times_each_token_arrived() -> None:
    trace = Trace.empty(2)
    trace.submitted = [0.0, 0.0]
    trace.tokens = [[0.010, 0.012, 0.014], [0.020, 0.030]]
    trace.ended = [0.014, 0.030]
    figures = summarize(trace, max_batch=2, mean_batch=1.5, occupancy=0.75)
    assert figures["tokens"] == 5 and figures["jobs"] == 2
    assert figures["tokens_per_s"] == pytest.approx(5 / 0.030, rel=1e-3)
    assert figures["ttft_p50_ms"] == pytest.approx(15.0)
    assert figures["itl_p50_ms"] == pytest.approx(2.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 50) is None


def test_targets_are_judged_against_the_issue_thresholds() -> None:
    def mode(tps: float, ttft: float = 1.0) -> dict[str, float]:
        return {"tokens_per_s": tps, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft,
                "itl_p50_ms": 1.0, "itl_p99_ms": 1.0}

    results = {
        "direct": {"64": mode(1000.0), "256": mode(2000.0)},
        "fleet": {"64": mode(950.0), "256": mode(1500.0)},
        "naive": mode(100.0),
        "low_load": {"direct": mode(0, 1.0), "fleet": mode(0, 2.5)},
        "overhead_costs": {"fleet_null_jobs_per_s": 5000.0, "celery_noop_jobs_per_s": 400.0,
                           "fleet_null_jobs_per_s_one_client": 1000.0,
                           "celery_noop_jobs_per_s_one_client": 400.0,
                           "publish_us_per_token": {"64": 7.0}},
        "memory": None,
        "cold_start": {"model": "tiny", "device": "cpu", "load_and_first_token_s": 1.2},
    }
    results["ratios"] = ratios(results)
    verdicts = {t["target"]: t["met"] for t in judge(results)}
    assert verdicts["tiny model load + first token, cold, CPU (s)"] is True  # 1.2 <= 2
    assert verdicts["fleet/direct tokens/s at 64"] is True  # 0.95 >= 0.90
    assert verdicts["fleet/direct tokens/s at 256"] is False  # 0.75 < 0.80
    assert verdicts["fleet/naive tokens/s at 64"] is True  # 9.5 >= 8
    assert verdicts["overhead runner / Celery no-op, jobs/s, full queue"] is True  # 12.5
    assert verdicts["added TTFT over direct, p50, low load (ms)"] is True  # 1.5 ms
    results["fleet"]["64"]["redis_commands_per_token"] = 0.25
    results["overhead"] = {"64": {**mode(5000.0), "redis_commands_per_token": 0.4}}
    verdicts = {t["target"]: t["met"] for t in judge(results)}
    assert verdicts["redis commands per token, fleet at 64"] is True  # 0.25 <= 0.3
    assert verdicts["redis commands per token, overhead at 64"] is False
