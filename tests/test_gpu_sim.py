"""The gpu-sim engine: one token per running sequence each step, never an end
of sequence, and its own count of the time its steps spent in the device; and
``tokenfleet bench --modes gpu-sim``, which reports what the fleet makes of it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.shared.wire.schemas import FinishReason, SamplingParams
from tokenfleet.shared.settings import Settings
from tokenfleet.bench.arrivals import (capacity_jobs_per_s, ideal_queue, open_loop_figures,
                                       poisson)
from tokenfleet.bench.gpu_sim_mode import figures, lines, sleep_late
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.bench.gpu_sim import TEXT, GpuSimEngine, build_gpu_sim
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def built() -> Any:
    return build_gpu_sim(Settings(max_batch=2, gpu_sim_step_ms=5, async_scheduling=False))


def sequence(tokenizer: Any, job_id: str, max_new_tokens: int) -> Sequence:
    return Sequence(job_id, tokenizer("a prompt")["input_ids"],
                    SamplingParams(max_new_tokens=max_new_tokens), TextStream(tokenizer))


def test_each_step_makes_one_token_per_running_sequence_and_the_rest_wait(built: Any) -> None:
    engine: GpuSimEngine = built.engine
    for i in range(3):
        engine.add(sequence(built.tokenizer, f"j{i}", 4))
    first = step(engine)
    assert [o.seq.job_id for o in first] == ["j0", "j1"]  # max_batch 2: j2 waits for a slot
    assert engine.num_running == 2 and engine.num_waiting == 1
    assert engine.last_batch.size == 2


def test_jobs_run_to_max_new_tokens_on_the_text_never_an_end_of_sequence(built: Any) -> None:
    engine: GpuSimEngine = built.engine
    tok = built.tokenizer
    long = len(engine.token_ids) + 5  # past the end of the text: it starts over
    engine.add(sequence(tok, "long", long))
    ended = []
    while engine.has_work:
        ended += [o for o in step(engine) if o.finished and o.seq.job_id == "long"]
    (out,) = ended
    ids = out.seq.generated
    assert len(ids) == long and out.seq.finish_reason == FinishReason.LENGTH
    assert not set(ids) & engine.eos_token_ids
    assert ids == (engine.token_ids * 2)[:long] and tok.decode(ids).startswith(TEXT)


def test_the_device_step_is_timed_by_batch_size_each_step_holding_the_sleep() -> None:
    built = build_gpu_sim(Settings(max_batch=4, gpu_sim_step_ms=5, async_scheduling=False))
    engine: GpuSimEngine = built.engine
    for i in range(4):
        engine.add(sequence(built.tokenizer, f"t{i}", 6))
    while engine.has_work:
        step(engine)
    figures: Any = engine.stats.as_dict()["gpu_sim"]
    # Six steps at batch 4; the last leaves no work, so its cycle never closes.
    times = figures["4"]
    assert set(figures) == {"4"} and times["steps"] == 5
    assert times["device_s"] >= 5 * 0.005
    assert times["step_s"] >= times["device_s"] and times["between_s"] >= 0
    assert engine.stats.tokens == 24 and times["tokens"] == 20


def run_to_the_end(engine: GpuSimEngine, tokenizer: Any, lengths: list[int],
                   between_s: float = 0.0) -> tuple[int, dict[str, list[int]]]:
    """Run jobs of these lengths to their ends, the engine thread busy for
    ``between_s`` after each step: (steps, each job's token ids)."""
    seqs = [sequence(tokenizer, f"j{i}", n) for i, n in enumerate(lengths)]
    for seq in seqs:
        engine.add(seq)
    steps = 0
    while engine.has_work:
        step(engine)
        steps += 1
        if between_s:
            time.sleep(between_s)  # the work of the engine thread between steps
    return steps, {s.job_id: list(s.generated) for s in seqs}


def test_one_step_ahead_a_steps_tokens_come_with_the_next_and_every_job_gets_the_same() -> None:
    sync, ahead = (build_gpu_sim(Settings(max_batch=2, gpu_sim_step_ms=1, async_scheduling=a))
                   for a in (False, True))
    engine: GpuSimEngine = ahead.engine
    engine.add(sequence(ahead.tokenizer, "first", 3))
    assert step(engine) == []  # launched; its tokens are taken at the next step
    (out,) = step(engine)
    assert out.seq.job_id == "first" and out.seq.generated == engine.token_ids[:1]
    while engine.has_work:
        step(engine)
    assert engine.num_held == 0

    lengths = [3, 7, 5, 1, 4]  # two slots: the later jobs wait for the ends of the first
    ahead = build_gpu_sim(Settings(max_batch=2, gpu_sim_step_ms=1, async_scheduling=True))
    sync_steps, sync_ids = run_to_the_end(sync.engine, sync.tokenizer, lengths)
    ahead_steps, ahead_ids = run_to_the_end(ahead.engine, ahead.tokenizer, lengths)
    assert ahead_ids == sync_ids
    assert [len(sync_ids[f"j{i}"]) for i in range(5)] == lengths
    # A job that ends at a step also fills its slot in the next, launched before
    # its end was known: its token is dropped, and the slot's next job comes a step later.
    assert ahead.engine.stats.tokens == sync.engine.stats.tokens == sum(lengths)
    assert sync_steps < ahead_steps <= sync_steps + len(lengths) + 1


def test_a_job_cancelled_while_its_step_runs_gets_no_token_from_that_step() -> None:
    built = build_gpu_sim(Settings(max_batch=2, gpu_sim_step_ms=1, async_scheduling=True))
    engine: GpuSimEngine = built.engine
    engine.add(sequence(built.tokenizer, "kept", 5))
    engine.add(sequence(built.tokenizer, "cancelled", 5))
    step(engine)  # both launched
    engine.abort("cancelled")
    made = step(engine)  # the cancel applies before the launched step's tokens are taken
    by_id = {o.seq.job_id: o for o in made}
    assert by_id["cancelled"].seq.finish_reason is FinishReason.CANCELLED
    assert by_id["cancelled"].seq.generated == []
    assert by_id["kept"].seq.generated == engine.token_ids[:1]


def test_one_step_ahead_the_device_runs_while_the_engine_thread_works() -> None:
    """The engine thread busy for half a step after each: one step at a time,
    the device waits that long every step; one step ahead, it never waits."""
    idle: dict[bool, float] = {}
    for ahead in (False, True):
        built = build_gpu_sim(Settings(max_batch=4, gpu_sim_step_ms=20, async_scheduling=ahead))
        run_to_the_end(built.engine, built.tokenizer, [12] * 4, between_s=0.01)
        times = built.engine.stats.as_dict()["gpu_sim"]["4"]  # type: ignore[index]
        idle[ahead] = times["idle_s"] / times["steps"]
        assert built.engine.stats.as_dict()["gpu_sim_async"] is ahead
    assert idle[False] >= 0.008  # about the half step the thread was away
    assert idle[True] < 0.005  # late only by what the OS takes to wake the thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl's timer slack is Linux's")
def test_the_device_step_ends_when_asked_not_a_timer_slack_later_on_the_engine_thread_only(
        built: Any) -> None:
    import ctypes
    import threading

    def slack() -> int:
        return int(ctypes.CDLL(None).prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK, in ns

    before, seen = slack(), []
    built.engine.add(sequence(built.tokenizer, "t", 2))

    def engine_thread() -> None:
        step(built.engine)
        seen.append(slack())

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join(10)
    assert seen == [1] and slack() == before


def test_steady_figures_are_the_full_batch_steps_of_the_run_less_the_warm_up() -> None:
    warm = {"2": {"steps": 3, "tokens": 6, "device_s": 0.03, "step_s": 0.033,
                  "between_s": 0.003}}
    after = {"2": {"steps": 103, "tokens": 206, "device_s": 1.03, "step_s": 1.083,
                   "between_s": 0.053, "idle_s": 0.05},
             "1": {"steps": 1, "tokens": 1, "device_s": 0.01, "step_s": 0.011,
                   "between_s": 0.001}, "async": False}
    f = figures(warm, after, batch=2, step_ms=10, jobs=2, max_new_tokens=100, tokens=200,
                elapsed_s=1.25)
    steady = f["steady"]
    # 100 steps of 2 tokens in 1.05 + 0.05 s; each step's 10 ms against 11 ms of cycle.
    assert f["ideal_tokens_per_s"] == 200
    assert steady["tokens_per_s"] == pytest.approx(200 / 1.1, abs=0.1)
    assert steady["in_step"] + steady["between_steps"] == pytest.approx(1, abs=1e-3)
    assert steady["in_device"] == pytest.approx(1.0 / 1.1, abs=1e-3)
    assert steady["device_late"] == pytest.approx(0, abs=1e-3)
    assert steady["device_idle"] == pytest.approx(0.05 / 1.1, abs=1e-3)
    assert f["whole_run"]["tokens_per_s"] == 160 and f["whole_run"]["of_ideal"] == 0.8
    assert next(lines(f)) == "gpu-sim step 10 ms batch 2: 182 tokens/s, 0.909 of ideal"
    assert "sleep_late" not in steady  # not timed: not printed


def test_steady_figures_one_step_ahead_count_the_tokens_made_not_the_slots() -> None:
    # 100 full steps of 2 slots, one slot's token dropped (its job had ended):
    # 199 tokens; the engine thread waited for the device for most of each step.
    after = {"2": {"steps": 100, "tokens": 199, "device_s": 0.9, "step_s": 0.98,
                   "between_s": 0.02, "idle_s": 0.0}, "async": True}
    f = figures({}, after, batch=2, step_ms=10, jobs=2, max_new_tokens=100, tokens=199,
                elapsed_s=1.25)
    steady = f["steady"]
    assert steady["tokens_per_s"] == pytest.approx(199.0) and steady["device_late"] is None
    assert steady["async_scheduling"] and steady["device_idle"] == 0
    assert list(lines(f))[3].startswith("  one step ahead (async scheduling): 0.900 waiting")


def test_the_machines_own_sleep_lateness_is_told_apart_from_the_fleets() -> None:
    times = {"2": {"steps": 100, "tokens": 200, "device_s": 1.05, "step_s": 1.08,
                   "between_s": 0.02}}
    f = figures({}, times, batch=2, step_ms=10, jobs=2, max_new_tokens=100, tokens=200,
                elapsed_s=1.25, sleep_late_s=0.0004)
    # 100 sleeps each 0.4 ms late, over the 1.1 s the 100 steps took.
    assert f["steady"]["sleep_late"] == pytest.approx(0.04 / 1.1, abs=1e-4)
    assert f["steady"]["device_late"] == pytest.approx(0.05 / 1.1, abs=1e-4)
    assert list(lines(f))[-1] == ("  a bare sleep of 10 ms on this machine ends late by 0.036 "
                                  "of the same time: the machine's part, not the fleet's")
    assert 0 < sleep_late(0.002, n=3) < 1


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_bench_mode_reports_tokens_per_second_against_the_ideal(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    result = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli.app", "bench", "--modes", "gpu-sim",
         "--step-ms", "2", "--concurrency", "4", "--jobs", "4", "--max-new-tokens", "8",
         "--json", str(out)],
        cwd=ROOT, env={**os.environ, "COLUMNS": "160"}, capture_output=True, text=True,
        timeout=170)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = re.search(r"^gpu-sim step 2 ms batch 4: ([\d,]+) tokens/s, (\d\.\d{3}) of ideal$",
                     result.stdout, re.MULTILINE)
    assert line, result.stdout
    ideal = 4 * 1000 / 2
    assert 0 < float(line[1].replace(",", "")) <= ideal * 1.05
    assert "whole run with the ramp" in result.stdout and "inside step()" in result.stdout
    figures = json.loads(out.read_text())["gpu_sim"]["4"]
    assert figures["whole_run"]["tokens"] == 4 * 8
    assert 0 < figures["steady"]["in_device"] <= figures["steady"]["in_step"] <= 1.001


def test_poisson_arrivals_come_at_the_rate_asked_the_same_every_run() -> None:
    times = poisson(4000, 200.0)
    assert times == poisson(4000, 200.0) and times == sorted(times)
    assert 4000 / times[-1] == pytest.approx(200.0, rel=0.05)
    assert capacity_jobs_per_s(256, 5.0, 128) == 400.0


def test_open_loop_figures_are_goodput_and_the_ttft_the_fleet_adds_to_one_step() -> None:
    """Four jobs of 10 tokens submitted over 0.3 s, the last ending at 1.0 s:
    40 tokens in 1.0 s against 50 offered a second; first tokens 10, 10, 15
    and 30 ms after their submits, against a floor of one 5 ms step."""
    records = [{"status": "succeeded", "created_at": 0.1 * i, "started_at": 0.1 * i,
                "first_token_at": 0.1 * i + ttft, "finished_at": 0.7 + 0.1 * i}
               for i, ttft in enumerate((0.010, 0.010, 0.015, 0.030))]
    records.append({"status": "failed", "created_at": 0.35, "started_at": None,
                    "first_token_at": None, "finished_at": 0.4})
    f = open_loop_figures(records, offered_tokens_per_s=50.0, max_new_tokens=10, step_ms=5.0)
    assert (f["jobs"], f["succeeded"]) == (5, 4)
    assert f["goodput_tokens_per_s"] == 40.0 and f["goodput_of_offered"] == 0.8
    assert f["ttft_p50_ms"] == pytest.approx(12.5) and f["added_ttft_p50_steps"] == 1.5
    assert f["ttft_p99_ms"] == pytest.approx(29.55) and f["ttft_floor_ms"] == 5.0


def test_a_perfect_fleet_adds_only_the_wait_for_a_step_and_a_free_slot() -> None:
    # One slot, jobs of two 10 ms steps: the first arrives at a step's start
    # (nothing added), the second waits for the slot until step 2 (1.9 steps
    # added), the third, arriving mid-step 2, for step 4 (1.5 steps).
    ideal = ideal_queue([0.0, 0.001, 0.025], batch=1, max_new_tokens=2, step_ms=10)
    assert ideal["added_ttft_p50_steps"] == 1.5
    assert ideal["added_ttft_p99_steps"] == pytest.approx(1.89, abs=0.01)
    # Below capacity, with slots to spare, only the wait for the next step is left.
    rate = 0.5 * capacity_jobs_per_s(256, 5.0, 128)
    calm = ideal_queue(poisson(3000, rate), 256, 128, 5.0)
    assert calm["added_ttft_p99_steps"] is not None and calm["added_ttft_p99_steps"] < 1


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_bench_mode_with_poisson_arrivals_reports_goodput_ttft_and_admission(
        tmp_path: Path) -> None:
    out = tmp_path / "arrivals.json"
    result = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli.app", "bench", "--modes", "gpu-sim",
         "--step-ms", "5", "--concurrency", "8", "--max-new-tokens", "8", "--arrivals",
         "poisson", "--load", "0.5", "--duration-s", "2", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "COLUMNS": "160"}, capture_output=True, text=True,
        timeout=170)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    f = json.loads(out.read_text())["arrivals"]["8"]
    # 8 x 1000 / 5 / 8 = 200 jobs a second of capacity, half of it for 2 s
    assert f["offered_jobs_per_s"] == 100.0 and f["jobs"] == f["succeeded"] == 200
    assert 0 < f["goodput_of_offered"] <= 1.2
    assert f["ttft_p50_ms"] >= 5.0 and f["added_ttft_p99_steps"] is not None
    assert f["admission_jobs_per_s"] > 0
    assert f["ideal_queue"]["added_ttft_p99_steps"] is not None
    assert f["device"]["steps"] > 0 and 0 < f["device"]["slots_used"] <= 1
    assert f["queued_p50_ms"] is not None and f["start_to_first_p50_ms"] is not None
    assert "of the 800 offered" in result.stdout and "jobs/s from a full queue" in result.stdout
    assert "a perfect fleet with the same arrivals" in result.stdout


def test_poisson_arrivals_go_with_the_gpu_sim_mode_alone() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli.app", "bench", "--modes", "fleet",
         "--arrivals", "poisson"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "poisson goes with --modes gpu-sim alone" in result.stdout + result.stderr
