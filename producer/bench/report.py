"""What a benchmark run tells: ratios, targets met or not, the table, the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenfleet.bench import arrivals, gpu_sim_mode, placement_mode, prefix_mode, redis_cost

# The fleet's targets, on a 2-core machine with the CPU build of torch.
FLEET_VS_DIRECT = {64: 0.90, 256: 0.80}
FLEET_VS_NAIVE = {64: 8.0}
OVERHEAD_VS_CELERY = 10.0
STREAM_US_PER_TOKEN = 20.0
ADDED_TTFT_MS = {"p50": 2.0, "p99": 10.0}
GROWTH_BYTES_PER_JOB = 64.0  # 100,000 jobs: under 6.4 MB, i.e. allocator noise
# The built-in tiny model on the CPU: a worker must come up fast.
TINY_LOAD_AND_FIRST_TOKEN_S = 2.0


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    fleet, direct, naive = results["fleet"], results["direct"], results["naive"]
    out: dict[str, Any] = {"fleet_vs_direct": {}, "fleet_vs_naive": {}}
    for c, figures in fleet.items():
        if c in direct:
            out["fleet_vs_direct"][c] = ratio(figures["tokens_per_s"],
                                               direct[c]["tokens_per_s"])
        if naive:
            out["fleet_vs_naive"][c] = ratio(figures["tokens_per_s"], naive["tokens_per_s"])
    low = results.get("low_load") or {}
    if "fleet" in low and "direct" in low:
        out["added_ttft_ms"] = {
            q: diff(low["fleet"][f"ttft_{q}_ms"], low["direct"][f"ttft_{q}_ms"])
            for q in ("p50", "p99")}
        out["added_itl_ms"] = {
            q: diff(low["fleet"][f"itl_{q}_ms"], low["direct"][f"itl_{q}_ms"])
            for q in ("p50", "p99")}
    costs = results.get("overhead_costs") or {}
    if "fleet_null_jobs_per_s" in costs and "celery_noop_jobs_per_s" in costs:
        out["overhead_vs_celery_noop"] = ratio(costs["fleet_null_jobs_per_s"],
                                                costs["celery_noop_jobs_per_s"])
        out["overhead_vs_celery_noop_one_client"] = ratio(
            costs["fleet_null_jobs_per_s_one_client"], costs["celery_noop_jobs_per_s_one_client"])
    return out


def diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def verdict(name: str, value: float, threshold: float, at_least: bool) -> dict[str, Any]:
    """A target's row: its value, threshold and whether it is met."""
    met = value >= threshold if at_least else value <= threshold
    return {"target": name, "value": value,
            "threshold": f"{'>=' if at_least else '<='} {threshold:g}", "met": met}


def judge(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target this run could measure: its value, threshold and verdict."""
    r = results["ratios"]
    targets: list[dict[str, Any]] = []

    def add(name: str, value: float | None, threshold: float, at_least: bool) -> None:
        if value is not None:
            targets.append(verdict(name, value, threshold, at_least))

    for c, want in FLEET_VS_DIRECT.items():
        add(f"fleet/direct tokens/s at {c}", r["fleet_vs_direct"].get(str(c)), want, True)
    for c, want in FLEET_VS_NAIVE.items():
        add(f"fleet/naive tokens/s at {c}", r["fleet_vs_naive"].get(str(c)), want, True)
    add("overhead runner / Celery no-op, jobs/s, full queue", r.get("overhead_vs_celery_noop"),
        OVERHEAD_VS_CELERY, True)
    costs = results.get("overhead_costs") or {}
    publish = costs.get("publish_us_per_token", {})
    add("streaming cost per token, worker side (us, 64 per step)", publish.get("64"),
        STREAM_US_PER_TOKEN, False)
    for q, limit in ADDED_TTFT_MS.items():
        add(f"added TTFT over direct, {q}, low load (ms)",
            (r.get("added_ttft_ms") or {}).get(q), limit, False)
    cold = results.get("cold_start")
    if cold and cold["model"] == "tiny" and cold["device"] == "cpu":
        add("tiny model load + first token, cold, CPU (s)", cold["load_and_first_token_s"],
            TINY_LOAD_AND_FIRST_TOKEN_S, False)
    memory = results.get("memory")
    if memory:
        add(f"worker memory growth per job over {memory['jobs']} jobs (bytes)",
            memory["growth_bytes_per_job"], GROWTH_BYTES_PER_JOB, False)
    return targets + redis_cost.targets(results)


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def render(results: dict[str, Any], console: Console) -> None:
    cfg = results["config"]
    dtype = "" if cfg.get("dtype", "auto") == "auto" else f"{cfg['dtype']}, "
    title = (f"tokenfleet bench: {cfg['model']} on {cfg['device']} ({dtype}{cfg['torch_threads']} "
             f"torch thread(s)), {cfg['jobs']} jobs x up to {cfg['max_new_tokens']} tokens"
             + {"mixed": " (mixed lengths), ", "shared-prefix": " (shared prefixes), "}.get(
                 cfg.get("workload", ""), ", ")
             + (f"{cfg['rate']:g} jobs/s" if cfg["rate"] else "all submitted at once"))
    table = Table(title=title, caption="TTFT and ITL in ms; overhead: the fleet with the null "
                  "runner (no model); naive: one Celery task per prompt, one at a time")
    for name in ("conc", "mode", "tokens/s", "jobs/s", "TTFT p50", "TTFT p99",
                 "ITL p50", "ITL p99", "occup.", "/direct", "/naive"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    r = results["ratios"]
    levels = sorted({int(c) for m in ("direct", "fleet", "overhead") for c in results[m]})
    for c in levels:
        for mode in ("direct", "fleet", "overhead"):
            f = results[mode].get(str(c))
            if f is None:
                continue
            is_fleet = mode == "fleet"
            table.add_row(
                str(c), mode,
                fmt(f["tokens_per_s"], 0), fmt(f["jobs_per_s"]), fmt(f["ttft_p50_ms"], 2),
                fmt(f["ttft_p99_ms"], 2), fmt(f["itl_p50_ms"], 2), fmt(f["itl_p99_ms"], 2),
                fmt(f["occupancy"], 2),
                fmt(r["fleet_vs_direct"].get(str(c)), 3) if is_fleet else "",
                fmt(r["fleet_vs_naive"].get(str(c)), 1) if is_fleet else "")
        table.add_section()
    naive = results["naive"]
    if naive:
        table.add_row("any", "naive", fmt(naive["tokens_per_s"], 0),
                      fmt(naive["jobs_per_s"]), fmt(naive["ttft_p50_ms"], 2),
                      fmt(naive["ttft_p99_ms"], 2), "-", "-", "-", "", "")
    if table.rows:  # none when only the absorb sweep ran
        console.print(table)
    _render_costs(results, console)
    redis_cost.render(results, console)
    for figures in results.get("gpu_sim", {}).values():
        for line in gpu_sim_mode.lines(figures):
            console.print(line, highlight=False, soft_wrap=True)
    for figures in results.get("arrivals", {}).values():
        for line in arrivals.lines(figures):
            console.print(line, highlight=False, soft_wrap=True)
    for batch, figures in results.get("prefix", {}).items():
        for line in prefix_mode.lines(figures, batch):
            console.print(line, highlight=False, soft_wrap=True)
    for figures in results.get("placement", {}).values():
        for line in placement_mode.lines(figures):
            console.print(line, highlight=False, soft_wrap=True)
    render_targets(results["targets"], console)


def _render_costs(results: dict[str, Any], console: Console) -> None:
    rows: list[tuple[str, str]] = []
    low = results.get("low_load") or {}
    r = results["ratios"]
    for mode in ("direct", "fleet"):
        if mode in low:
            f = low[mode]
            rows.append((f"low load ({mode}, one job at a time): TTFT p50 / p99 ms",
                         f"{fmt(f['ttft_p50_ms'], 2)} / {fmt(f['ttft_p99_ms'], 2)}"))
    if "added_ttft_ms" in r:
        a = r["added_ttft_ms"]
        rows.append(("added TTFT over direct, p50 / p99 ms",
                     f"{fmt(a['p50'], 2)} / {fmt(a['p99'], 2)}"))
    cold = results.get("cold_start")
    if cold:
        rows.append((f"model load + first token, cold, in one process ({cold['model']}, s)",
                     fmt(cold["load_and_first_token_s"], 2)))
    costs = results.get("overhead_costs") or {}
    for key, label in (
        ("fleet_null_jobs_per_s", "overhead runner, 1-token jobs, full queue: jobs/s"),
        ("celery_noop_jobs_per_s", "plain Celery no-op tasks, full queue: jobs/s"),
        ("fleet_null_jobs_per_s_one_client", "overhead runner, 1-token jobs, one client: jobs/s"),
        ("celery_noop_jobs_per_s_one_client", "plain Celery no-op tasks, one client: jobs/s"),
        ("fleet_worker_cpu_us_per_job", "fleet worker CPU per job (us)"),
        ("fleet_redis_cpu_us_per_job", "redis CPU per fleet job (us)"),
        ("celery_worker_cpu_us_per_job", "Celery worker CPU per no-op task (us)"),
        ("fleet_worker_cpu_us_per_token", "fleet worker CPU per token (us)"),
        ("fleet_redis_cpu_us_per_token", "redis CPU per token (us)"),
    ):
        if key in costs:
            rows.append((label, fmt(costs[key], 1)))
    if "overhead_vs_celery_noop" in r:
        rows.append(("overhead runner / Celery no-op, jobs/s (full queue; one client)",
                     f"{fmt(r['overhead_vs_celery_noop'], 1)}; "
                     f"{fmt(r['overhead_vs_celery_noop_one_client'], 1)}"))
    for b, us in (costs.get("publish_us_per_token") or {}).items():
        rows.append((f"publish() per token, {b} tokens per step (us)", fmt(us, 2)))
    memory = results.get("memory")
    if memory:
        rows.append((f"worker RSS over {memory['jobs']:,} jobs (MB; batch {memory['max_batch']})",
                     f"{memory['rss_after_10pct_mb']} -> {memory['rss_end_mb']} "
                     f"({memory['growth_bytes_per_job']:+.1f} "
                     f"+-{memory['growth_bytes_per_job_ci95']:.1f} B/job)"))
    if not rows:
        return
    table = Table(title="latency at low load, overhead and memory")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def render_targets(targets: list[dict[str, Any]], console: Console,
                   title: str = "targets") -> None:
    if not targets:
        return
    table = Table(title=title)
    for name in ("target", "value", "threshold", "met"):
        table.add_column(name, justify="left" if name == "target" else "right")
    for t in targets:
        table.add_row(t["target"], fmt(t["value"], 3), t["threshold"],
                      "[green]yes[/green]" if t["met"] else "[red]no[/red]")
    console.print(table)


def plot(results: dict[str, Any], path: Path) -> Path:
    """Throughput against concurrency, one line per mode (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'tokenfleet[bench]'") from exc
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, label, style in (("direct", "direct (in-process)", "o-"),
                               ("fleet", "fleet", "s-"),
                               ("overhead", "overhead (null runner)", "^--")):
        points = sorted((int(c), f["tokens_per_s"]) for c, f in results[mode].items())
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    naive = results["naive"]
    if naive:
        ax.axhline(naive["tokens_per_s"], color="grey", linestyle=":",
                   label="naive Celery (1 task at a time)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent jobs (batch size)")
    ax.set_ylabel("tokens/s")
    cfg = results["config"]
    ax.set_title(f"tokenfleet bench: {cfg['model']}, {cfg['torch_threads']} thread(s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
