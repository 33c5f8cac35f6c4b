"""The whole benchmark: every mode at every concurrency, on one machine, in one run.

For each concurrency (the engine's batch size: 1, 4, 16, 64, 256 jobs at once)
the direct mode and the fleet run back to back on the same jobs, then the
overhead mode (the fleet with the null runner). The naive Celery worker runs
one task at a time whatever the concurrency, so it runs once. A low-load probe
(one job at a time) measures what the fleet adds to the time to first token,
and ``soak`` passes many jobs through one worker while watching its memory.
``absorb`` sweeps K null-runner workers at each batch size against one Redis
(``redis_cost``). ``gpu-sim`` runs one worker of the gpu-sim engine at each
concurrency: how much of a GPU's tokens the fleet passes on (``gpu_sim_mode``).
``prefix`` runs the built-in engine with its prefix cache, without it, and on
the rectangular cache, the same jobs through each (``prefix_mode``).
``placement`` runs two workers with placement by prefix against two without
(``placement_mode``).
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from tokenfleet.shared.redis.url import redacted
from tokenfleet.shared.settings import get_settings
from tokenfleet.bench import arrivals, gpu_sim_mode, placement_mode, prefix_mode, redis_cost
from tokenfleet.bench.modes import BenchEnv, Direct, FleetSession, NaiveSession, Tick, publish_cost
from tokenfleet.bench.procs import BenchError, RedisProc
from tokenfleet.bench.report import judge, ratios
from tokenfleet.bench.workload import WORKLOADS, Job, describe, make_jobs
from tokenfleet.workers.null_runner import NULL_MODEL

MODES = ("direct", "fleet", "naive", "overhead", "absorb", "gpu-sim", "prefix", "placement")
ARRIVALS = ("at-once", "poisson")


@dataclass
class BenchConfig:
    model: str = "tiny"
    jobs: int = 256
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 256])
    max_new_tokens: int = 32
    workload: str = "uniform"  # or "mixed": long-tailed lengths (workload.make_jobs)
    rate: float | None = None  # jobs per second; None: all submitted at once
    modes: list[str] = field(default_factory=lambda: list(MODES))
    redis_url: str | None = None
    device: str = "cpu"
    dtype: str = "auto"  # every mode loads the model in this dtype
    probe_jobs: int = 50  # the low-load probe: one job at a time
    overhead_jobs: int = 2000  # one-token jobs (and Celery no-op tasks) for the per-job cost
    soak: int = 0  # jobs through one worker while its memory is watched; 0: no soak
    repeat: int = 1  # runs of each measurement, taking turns; the best one is kept
    absorb_workers: list[int] = field(default_factory=lambda: [1, 2, 4])  # K of the sweep
    absorb_tokens: int = 200_000  # tokens per point of the sweep
    step_ms: float = 10.0  # gpu-sim: the simulated device step
    sim_jobs: int | None = None  # gpu-sim: jobs per run; None: the concurrency
    arrivals: str = "at-once"  # gpu-sim: or "poisson", at ``load`` of its capacity
    load: float = 0.9  # gpu-sim with Poisson arrivals: the share of its capacity offered
    duration_s: float = 60.0  # gpu-sim with Poisson arrivals: how long jobs arrive

    def check(self) -> None:
        unknown = set(self.modes) - set(MODES)
        if unknown:
            raise BenchError(f"unknown mode(s) {', '.join(sorted(unknown))}; "
                             f"choose from {', '.join(MODES)}")
        if self.workload not in WORKLOADS:
            raise BenchError(f"unknown workload {self.workload!r}; choose from "
                             f"{', '.join(WORKLOADS)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise BenchError("--concurrency needs one or more positive numbers, e.g. 1,4,16")
        if not self.absorb_workers or min(self.absorb_workers) < 1 or self.absorb_tokens < 1:
            raise BenchError("--absorb-workers needs one or more positive numbers, e.g. 1,2,4, "
                             "and --absorb-tokens a positive number")
        if self.step_ms <= 0 or (self.sim_jobs is not None and self.sim_jobs < 1):
            raise BenchError("--step-ms must be above 0 and --jobs at least 1")
        if self.arrivals not in ARRIVALS or (self.arrivals == "poisson" and (
                self.modes != ["gpu-sim"] or self.load <= 0 or self.duration_s <= 0)):
            raise BenchError(f"--arrivals is one of {', '.join(ARRIVALS)}; poisson goes with "
                             "--modes gpu-sim alone, a --load above 0 and a --duration-s above 0")
        if (min(self.jobs, self.max_new_tokens, self.probe_jobs, self.repeat) < 1
                or self.overhead_jobs < 2):
            raise BenchError("--jobs, --max-new-tokens, --probe-jobs and --repeat must be at "
                             "least 1, --overhead-jobs at least 2")


class Ticker:
    """The progress bar: one line per phase, advanced as jobs end."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    @contextmanager
    def phase(self, label: str, total: int) -> Iterator[Tick]:
        task = self.progress.add_task(label, total=total)
        try:
            yield lambda n: self.progress.advance(task, n)
        finally:
            self.progress.update(task, completed=total)


def torch_threads(device: str) -> int:
    """The same intra-op thread count for the direct mode and every worker."""
    from tokenfleet.shared.settings import Settings
    from tokenfleet.workers.build import cpu_threads

    return cpu_threads(Settings(device=device))


def run_bench(cfg: BenchConfig, console: Console | None = None) -> dict[str, Any]:
    cfg.check()
    console = console or Console(stderr=True)
    threads = torch_threads(cfg.device)
    jobs = make_jobs(cfg.jobs, cfg.max_new_tokens, cfg.rate, workload=cfg.workload)
    probe = [Job(j.prompt, j.max_new_tokens, 0.0)
             for j in make_jobs(cfg.probe_jobs, cfg.max_new_tokens, workload=cfg.workload)]
    started = time.time()
    with ExitStack() as stack:
        if cfg.redis_url is None:
            server = RedisProc()
            stack.callback(server.close)
            url = server.url
        else:
            url = cfg.redis_url
        env = BenchEnv(url, cfg.model, cfg.device, threads, uuid.uuid4().hex[:8], cfg.dtype)
        progress = stack.enter_context(Progress(
            SpinnerColumn(), TextColumn("{task.description:<28}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(), console=console,
            refresh_per_second=4))
        ticker = Ticker(progress)
        results = _run_modes(cfg, env, jobs, probe, ticker)
        if cfg.redis_url is not None:
            _clean(url, env.run_id)
    results["config"] = {
        **asdict(cfg), "redis_url": cfg.redis_url and redacted(cfg.redis_url),
        "torch_threads": threads,
        "redis": "given" if cfg.redis_url else "spawned",
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "torch": version("torch"), "transformers": version("transformers"),
        "started_at": started, "duration_s": round(time.time() - started, 1),
    }
    results["workload"] = describe(jobs)
    results["ratios"] = ratios(results)
    results["targets"] = judge(results)
    return results


def _run_modes(cfg: BenchConfig, env: BenchEnv, jobs: list[Job], probe: list[Job],
               ticker: Ticker) -> dict[str, Any]:
    modes = set(cfg.modes)
    out: dict[str, Any] = {"direct": {}, "fleet": {}, "naive": None, "overhead": {},
                           "overhead_costs": None, "low_load": None, "memory": None,
                           "absorb": None, "cold_start": None, "gpu_sim": {}, "prefix": {},
                           "arrivals": {}, "placement": {}}
    direct = None
    if "direct" in modes:
        with ticker.phase("loading the model", 1):
            direct = Direct(cfg.model, cfg.device, env.threads, cfg.dtype)
        out["cold_start"] = {"model": cfg.model, "device": cfg.device,
                             "load_and_first_token_s": direct.load_and_first_token_s}
    levels = sorted(set(cfg.concurrency))
    for c in levels:
        with ExitStack() as stack:
            fleet = null = None
            if "fleet" in modes:
                fleet = stack.enter_context(closing(_start(
                    ticker, f"fleet    c={c}", FleetSession, env, f"fleet-c{c}", cfg.model, c)))
                fleet.warm(jobs)
            if "overhead" in modes:
                null = stack.enter_context(closing(_start(
                    ticker, f"overhead c={c}", FleetSession, env, f"null-c{c}", NULL_MODEL, c)))
                null.warm(jobs)
            # The modes take turns, so a burst of other load on the machine hits
            # them alike; each keeps its best run of the --repeat.
            for mode, session in (("direct", direct), ("fleet", fleet), ("overhead", null)):
                if session is not None:
                    out[mode][str(c)] = []
            for r in range(cfg.repeat):
                suffix = f" ({r + 1}/{cfg.repeat})" if cfg.repeat > 1 else ""
                if direct is not None:
                    with ticker.phase(f"direct   c={c}{suffix}", len(jobs)) as tick:
                        out["direct"][str(c)].append(direct.run(jobs, c, tick))
                for mode, session in (("fleet", fleet), ("overhead", null)):
                    if session is not None:
                        with ticker.phase(f"{mode:<8} c={c}{suffix}", len(jobs)) as tick:
                            out[mode][str(c)].append(session.run(jobs, tick))
            for mode in ("direct", "fleet", "overhead"):
                if str(c) in out[mode]:
                    out[mode][str(c)] = _best(out[mode][str(c)])
            if c == levels[0] and (direct is not None or fleet is not None):
                out["low_load"] = _low_load(cfg, probe, direct, fleet, c, ticker)
            if null is not None and c == levels[-1]:
                out["overhead_costs"] = _overhead_costs(cfg, env, null, out["overhead"][str(c)],
                                                        ticker, direct)
    if "naive" in modes or "overhead" in modes:
        with closing(_start(ticker, "naive celery", NaiveSession, env)) as naive:
            if "naive" in modes:
                naive.warm("naive.generate")
                runs = []
                for r in range(cfg.repeat):
                    with ticker.phase("naive celery", len(jobs)) as tick:
                        runs.append(naive.run("naive.generate", jobs, tick))
                out["naive"] = _best(runs)
            if "overhead" in modes:
                one = _one_token_jobs(cfg)
                naive.warm("naive.noop")
                with ticker.phase("celery no-op tasks", len(one)) as tick:
                    noop = naive.run("naive.noop", one, tick)
                runs = []
                for r in range(cfg.repeat):
                    with ticker.phase("celery no-op, full queue", len(one)) as tick:
                        runs.append(naive.prefilled("naive.noop", one, tick))
                sustained = _best(runs, "jobs_per_s")
                costs = out["overhead_costs"] or {}
                costs["celery_noop"] = noop
                costs["celery_noop_full_queue"] = sustained
                costs["celery_noop_jobs_per_s"] = sustained["jobs_per_s"]
                costs["celery_noop_jobs_per_s_one_client"] = noop["jobs_per_s"]
                costs["celery_worker_cpu_us_per_job"] = round(
                    noop["worker_cpu_s"] / max(1, noop["jobs"]) * 1e6, 1)
                out["overhead_costs"] = costs
    if cfg.soak:
        out["memory"] = _soak(cfg, env, ticker)
    if "prefix" in modes:
        for c in levels:
            out["prefix"][str(c)] = prefix_mode.run(env, cfg.model, c, cfg.jobs,
                                                    cfg.max_new_tokens, cfg.workload,
                                                    cfg.repeat, ticker.phase)
    if "placement" in modes:
        steal_ms = get_settings().affinity_steal_ms
        for c in levels:
            out["placement"][str(c)] = placement_mode.run(env, cfg.model, c, cfg.jobs,
                                                          cfg.max_new_tokens, cfg.repeat,
                                                          steal_ms, ticker.phase, cfg.rate)
    if "gpu-sim" in modes and cfg.arrivals == "poisson":
        for c in levels:
            out["arrivals"][str(c)] = arrivals.run(env, c, cfg.max_new_tokens, cfg.step_ms,
                                                   cfg.load, cfg.duration_s, ticker.phase)
    elif "gpu-sim" in modes:
        for c in levels:
            out["gpu_sim"][str(c)] = gpu_sim_mode.run(env, c, cfg.sim_jobs or c,
                                                      cfg.max_new_tokens, cfg.step_ms,
                                                      ticker.phase)
    if "absorb" in modes:
        out["absorb"] = redis_cost.absorb(env, levels, cfg.absorb_workers, cfg.absorb_tokens,
                                          ticker.phase)
    return out


def _best(runs: list[dict[str, Any]], key: str = "tokens_per_s") -> dict[str, Any]:
    """The run with the highest ``key`` (the one other load disturbed least), with
    every run's ``key`` beside it."""
    best = dict(max(runs, key=lambda f: f[key] or 0.0))
    best["runs"] = [f[key] for f in runs]
    return best


def _low_load(cfg: BenchConfig, probe: list[Job], direct: Direct | None,
              fleet: FleetSession | None, c: int, ticker: Ticker) -> dict[str, Any]:
    """One job at a time: what the fleet adds to the time to first token."""
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "fleet": []}
    for r in range(cfg.repeat):
        if direct is not None:
            with ticker.phase("direct   low load", len(probe)) as tick:
                runs["direct"].append(direct.run(probe, c, tick, closed_loop=True))
        if fleet is not None:
            with ticker.phase("fleet    low load", len(probe)) as tick:
                runs["fleet"].append(fleet.run(probe, tick, closed_loop=True))
    return {mode: _fastest(r) for mode, r in runs.items() if r}


def _fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = dict(min(runs, key=lambda f: f["ttft_p50_ms"] or float("inf")))
    best["runs"] = [f["ttft_p50_ms"] for f in runs]
    return best


def _start(ticker: Ticker, label: str, factory: Any, *args: Any, **kwargs: Any) -> Any:
    """Start a worker process (seconds: Celery, torch, the model), on the progress bar."""
    with ticker.phase(f"{label}: starting", 1):
        return factory(*args, **kwargs)


def _overhead_costs(cfg: BenchConfig, env: BenchEnv, session: FleetSession,
                    run: dict[str, Any], ticker: Ticker, direct: Direct | None) -> dict[str, Any]:
    """What the fleet costs per job and per token, with no model in the way."""
    one = _one_token_jobs(cfg)
    with ticker.phase("overhead 1-token jobs", len(one)) as tick:
        per_job = session.run(one, tick)
    runs = []
    for r in range(cfg.repeat):
        with ticker.phase("overhead 1-token, full queue", len(one)) as tick:
            runs.append(session.prefilled(one, tick))
    sustained = _best(runs, "jobs_per_s")
    job_cpu = per_job["worker_cpu_s"] / max(1, per_job["jobs"])
    job_redis = per_job["redis_cpu_s"] / max(1, per_job["jobs"])
    # The same jobs with all their tokens, less what the jobs themselves cost.
    extra_tokens = max(1, run["tokens"] - run["jobs"])
    token_cpu = (run["worker_cpu_s"] - run["jobs"] * job_cpu) / extra_tokens
    token_redis = (run["redis_cpu_s"] - run["jobs"] * job_redis) / extra_tokens
    tokenizer = direct.tokenizer if direct is not None else _tokenizer()
    publish = {str(b): round(publish_cost(env.redis_url, env.namespace(f"micro{b}"), tokenizer,
                                          b), 2)
               for b in (1, 64, 256)}
    return {
        "fleet_null_one_token": per_job,
        "fleet_null_full_queue": sustained,
        "fleet_null_jobs_per_s": sustained["jobs_per_s"],
        "fleet_null_jobs_per_s_one_client": per_job["jobs_per_s"],
        "fleet_worker_cpu_us_per_job": round(job_cpu * 1e6, 1),
        "fleet_redis_cpu_us_per_job": round(job_redis * 1e6, 1),
        "fleet_worker_cpu_us_per_token": round(max(0.0, token_cpu) * 1e6, 2),
        "fleet_redis_cpu_us_per_token": round(max(0.0, token_redis) * 1e6, 2),
        "publish_us_per_token": publish,  # by tokens per step
    }


def _one_token_jobs(cfg: BenchConfig) -> list[Job]:
    """The per-job probe: the same prompts, one token each (a no-op task's twin)."""
    return [Job(j.prompt, 1, 0.0) for j in make_jobs(cfg.overhead_jobs, 1)]


SOAK_BATCH = 16  # a 256-row KV cache alone swings RSS by tens of MB, hiding any per-job trend


def _soak(cfg: BenchConfig, env: BenchEnv, ticker: Ticker) -> dict[str, Any]:
    """Many short jobs through one worker: its resident memory must not grow per job."""
    batch = min(SOAK_BATCH, max(cfg.concurrency))
    jobs = [Job(j.prompt, 2, 0.0) for j in make_jobs(cfg.soak, 2)]
    with closing(_start(ticker, "soak", FleetSession, env, "soak", cfg.model, batch,
                        record=False)) as session:
        session.warm(jobs)
        with ticker.phase(f"soak {cfg.soak} jobs", len(jobs)) as tick:
            t0 = time.perf_counter()
            samples = session.soak(jobs, window=2 * batch + 64, tick=tick)
            elapsed = time.perf_counter() - t0
    settled = [(n, rss) for n, rss in samples if n >= len(jobs) // 10]
    slope, margin = _slope(settled)
    first, last = settled[0][1], settled[-1][1]
    return {
        "jobs": len(jobs), "model": cfg.model, "max_batch": batch,
        "jobs_per_s": round(len(jobs) / elapsed, 1),
        "rss_start_mb": round(samples[0][1] / 2**20, 1),
        "rss_after_10pct_mb": round(first / 2**20, 1),
        "rss_end_mb": round(last / 2**20, 1),
        "rss_min_mb": round(min(r for _, r in settled) / 2**20, 1),
        "rss_max_mb": round(max(r for _, r in settled) / 2**20, 1),
        "growth_after_10pct_mb": round((last - first) / 2**20, 2),
        "growth_bytes_per_job": round(slope, 2),
        "growth_bytes_per_job_ci95": round(margin, 2),
        "samples": [[n, round(rss / 2**20, 2)] for n, rss in samples],
    }


def _slope(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares bytes per job, and the half-width of its 95% interval."""
    if len(points) < 3:
        return 0.0, 0.0
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if not sxx:
        return 0.0, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return slope, 1.96 * (residual / (len(xs) - 2) / sxx) ** 0.5


def _tokenizer() -> Any:
    from tokenfleet.workers.null_runner import null_tokenizer

    return null_tokenizer()


def _clean(url: str, run_id: str) -> None:
    """A shared Redis keeps nothing of the benchmark's (its keys share one prefix)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        batch = []
        for key in client.scan_iter(match=f"bench-{run_id}-*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
    finally:
        client.close()


def version(module: str) -> str | None:
    try:
        return str(__import__(module).__version__)
    except Exception:  # a version is a nicety, never a reason to fail the run
        return None
