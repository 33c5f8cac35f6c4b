"""``--modes prefix``: what the built-in engine's prefix cache saves, and which
KV cache should be the default.

Three workers of the built-in engine on the same model and batch size, the
same jobs through each, taking turns: the paged KV cache with its prefix
cache (``prefix``), the paged cache without it (``paged``), and the
rectangular cache (``rect``). Each run's figures are the fleet mode's plus
the prompt tokens the model computed (the worker's ``prefill_tokens``) and
what the prefix cache found; the outputs are compared token for token (greedy
decoding: a cache that changed a result shows here).

Round ``r`` runs jobs of seed ``r``: user turns no round saw before. With
``--workload shared-prefix`` every round has the same 16 system prompts, which
the workers' warm-up (a seed of its own) never saw: the first round finds them
cold and computes each once, the later ones find them cached, as a service
does once its system prompts have been asked for (``cold`` and ``warm``
below). Each figure is the median of the rounds; ``--workload shared-prefix``
is the load the cache is for, and ``uniform`` the plain load the default is
judged on.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, closing
from typing import Any

from tokenfleet.bench.figures import num
from tokenfleet.bench.modes import BenchEnv, FleetSession
from tokenfleet.bench.workload import Job, make_jobs, shared_prefix

Tick = Callable[[int], None]
Phase = Callable[[str, int], AbstractContextManager[Tick]]

# The workers compared, by the settings that make each.
VARIANTS: dict[str, dict[str, str]] = {
    "prefix": {"TOKENFLEET_KV_CACHE": "paged", "TOKENFLEET_PREFIX_CACHE": "true"},
    "paged": {"TOKENFLEET_KV_CACHE": "paged", "TOKENFLEET_PREFIX_CACHE": "false"},
    "rect": {"TOKENFLEET_KV_CACHE": "rect"},
}
WARM_SEED = 1_000_000  # the warm-up's jobs: prompts no round runs
# The worker's counters each run reports the change of.
COUNTERS = ("prefill_tokens", "prefix_query_tokens", "prefix_hit_tokens")
# The figures of a run whose median across the rounds is reported.
MEDIANS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "elapsed_s", *COUNTERS)


def run(env: BenchEnv, model: str, batch: int, jobs: int, max_new_tokens: int, workload: str,
        rounds: int, phase: Phase) -> dict[str, Any]:
    """Every variant at ``batch``, ``rounds`` rounds of ``jobs`` jobs; the
    figures of each (medians), their ratios, and how many outputs matched."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    mismatched: dict[str, int] = {name: 0 for name in VARIANTS if name != "prefix"}
    compared = 0
    with ExitStack() as stack:
        sessions = {}
        for name, settings in VARIANTS.items():
            with phase(f"prefix   {name} c={batch}: starting", 1):
                sessions[name] = stack.enter_context(closing(FleetSession(
                    env, f"prefix-{name}-c{batch}", model, batch, settings=settings)))
        warm = make_jobs(batch, max_new_tokens, workload=workload, seed=WARM_SEED)
        for session in sessions.values():
            session.warm(warm)
        for r in range(rounds):
            round_jobs = (shared_prefix(jobs, max_new_tokens, seed=r, system_seed=0)
                          if workload == "shared-prefix"
                          else make_jobs(jobs, max_new_tokens, workload=workload, seed=r))
            outputs = {}
            for name, session in sessions.items():
                label = f"prefix   {name} c={batch} ({r + 1}/{rounds})"
                with phase(label, len(round_jobs)) as tick:
                    runs[name].append(_one_run(session, round_jobs, tick))
                outputs[name] = _outputs(session)
            compared += len(round_jobs)
            for name in mismatched:
                mismatched[name] += sum(a != b for a, b in zip(outputs["prefix"], outputs[name]))
    figures = {name: _medians(rs) for name, rs in runs.items()}
    return {**figures, "rounds": rounds, "jobs": jobs,
            "outputs_compared": compared, "outputs_differing": mismatched,
            "ratios": {**_ratios(figures), **_cold_and_warm(runs)}}


def _one_run(session: FleetSession, jobs: list[Job], tick: Tick) -> dict[str, Any]:
    before = session.stats()
    figures = session.run(jobs, tick)
    after = session.settled_stats(session.jobs_seen)
    for counter in COUNTERS:
        figures[counter] = after.get(counter, 0) - before.get(counter, 0)
    return figures


def _outputs(session: FleetSession) -> list[tuple[int, ...]]:
    """The token ids of each job of the session's last run, in order."""
    return [tuple(session.client.status(job_id).token_ids or ()) for job_id in session.last_ids]


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds, with every round's tokens/s."""
    out: dict[str, Any] = {}
    for key in MEDIANS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
    out["runs"] = [r["tokens_per_s"] for r in runs]
    return out


def _ratios(figures: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The prefix cache against the paged cache without it, and against ``rect``."""
    prefix, paged, rect = figures["prefix"], figures["paged"], figures["rect"]

    def ratio(a: Any, b: Any) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {
        "prefill_tokens_vs_paged": ratio(prefix["prefill_tokens"], paged["prefill_tokens"]),
        "hit_rate": ratio(prefix["prefix_hit_tokens"], prefix["prefix_query_tokens"]),
        "ttft_p50_vs_paged": ratio(prefix["ttft_p50_ms"], paged["ttft_p50_ms"]),
        "tokens_per_s_vs_paged": ratio(prefix["tokens_per_s"], paged["tokens_per_s"]),
        "ttft_p50_vs_rect": ratio(prefix["ttft_p50_ms"], rect["ttft_p50_ms"]),
        "tokens_per_s_vs_rect": ratio(prefix["tokens_per_s"], rect["tokens_per_s"]),
    }


def _cold_and_warm(runs: dict[str, list[dict[str, Any]]]) -> dict[str, float | None]:
    """Prompt tokens computed with the cache against without it: in the first
    round (its system prompts new to the cache) and the median of the later ones."""
    by_round = [p["prefill_tokens"] / q["prefill_tokens"] if q["prefill_tokens"] else None
                for p, q in zip(runs["prefix"], runs["paged"])]
    later = [x for x in by_round[1:] if x is not None]
    return {"prefill_tokens_vs_paged_cold": by_round[0] and round(by_round[0], 3),
            "prefill_tokens_vs_paged_warm": round(statistics.median(later), 3) if later else None}


def lines(f: dict[str, Any], batch: str) -> Iterator[str]:
    """The figures at one batch size as the bench prints them."""
    yield (f"prefix cache, batch {batch}, {f['jobs']} jobs, median of {f['rounds']} round(s) "
           "(tokens/s, TTFT p50 ms, prompt tokens computed, found cached):")
    for name in VARIANTS:
        v = f[name]
        yield (f"  {name:<6} {num(v['tokens_per_s'])} tokens/s, TTFT p50 "
               f"{num(v['ttft_p50_ms'], 1)}, computed {num(v['prefill_tokens'])}, "
               f"cached {num(v['prefix_hit_tokens'])}")
    r = f["ratios"]
    yield (f"  prefix vs paged: prompt tokens computed {num(r['prefill_tokens_vs_paged'], 3)}x, "
           f"TTFT p50 {num(r['ttft_p50_vs_paged'], 3)}x, tokens/s "
           f"{num(r['tokens_per_s_vs_paged'], 3)}x; hit rate {num(r['hit_rate'], 3)}")
    yield (f"  prompt tokens computed, prefix vs paged: the first round (cold) "
           f"{num(r['prefill_tokens_vs_paged_cold'], 3)}x, later rounds (warm) "
           f"{num(r['prefill_tokens_vs_paged_warm'], 3)}x")
    yield (f"  prefix vs rect: TTFT p50 {num(r['ttft_p50_vs_rect'], 3)}x, tokens/s "
           f"{num(r['tokens_per_s_vs_rect'], 3)}x")
    differing = ", ".join(f"{n} {k}" for n, k in f["outputs_differing"].items())
    yield (f"  greedy outputs of {f['outputs_compared']} jobs differing from the prefix "
           f"cache's: {differing}")

