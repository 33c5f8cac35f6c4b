"""``--modes placement``: two workers with placement by prefix against two without.

Two fleets of two workers each, the built-in engine with its paged cache and
prefix cache, on one Redis: ``scatter`` (``TOKENFLEET_AFFINITY`` off: whichever
worker reads first takes a job) and ``placed`` (on: a job goes to the worker
that holds its prefix, ``workers/affinity.py``). The same jobs run through each,
taking turns, after a warm-up that runs the rounds' system prompts once (as a
service that has been asked for them before):

- the shared-prefix load (``workload.shared_prefix``: 16 system prompts): the
  fleet's prefix hit rate (both workers' prompt tokens found cached over those
  looked up), TTFT p50 and tokens/s;
- one hot prefix (80% of the jobs have the first system prompt): each worker's
  share of the tokens (the smaller over the larger: both busy), the jobs taken
  from a busy owner's stream, and how long the jobs placed on an owner waited
  to start.

Times are the records' (Redis's clock): TTFT is created to first token.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, closing
from typing import Any

import redis

from tokenfleet import FleetClient
from tokenfleet.bench.figures import num
from tokenfleet.bench.modes import BenchEnv
from tokenfleet.bench.procs import CeleryProc, wait_for
from tokenfleet.bench.redis_cost import cost, sample
from tokenfleet.bench.workload import Job, percentile, shared_prefix
from tokenfleet.shared.settings import get_settings
from tokenfleet.shared.wire.keys import Keys, owner_tag
from tokenfleet.shared.wire.serialization import loads

Tick = Callable[[int], None]
Phase = Callable[[str, int], AbstractContextManager[Tick]]

FLEETS = {"scatter": "false", "placed": "true"}
WORKERS = 2
HOT = 0.8  # the hot load's share of jobs with the first system prompt
WARM_SEED = 1_000_000
COUNTERS = ("prefix_query_tokens", "prefix_hit_tokens", "prefill_tokens")


class Pair:
    """Two workers of one fleet (a namespace of its own) and a client."""

    def __init__(self, env: BenchEnv, label: str, model: str, max_batch: int,
                 affinity: str, steal_ms: int) -> None:
        namespace = env.namespace(label)
        self.keys = Keys(namespace)
        self.redis = redis.Redis.from_url(env.redis_url)
        self.client = FleetClient(env.redis_url, namespace=namespace,
                                  settings=get_settings().model_copy(update={
                                      "require_worker": False,
                                      "affinity": affinity == "true"}))
        threads = str(max(1, env.threads // WORKERS))  # the machine's cores, shared
        self.nodes = [f"{label}-{i}@bench" for i in range(WORKERS)]
        self.workers = [CeleryProc("tokenfleet.workers.app", node, {
            **env.worker_env(namespace, model, max_batch),
            "TOKENFLEET_TORCH_THREADS": threads, "TOKENFLEET_KV_CACHE": "paged",
            "TOKENFLEET_PREFIX_CACHE": "true", "TOKENFLEET_AFFINITY": affinity,
            "TOKENFLEET_AFFINITY_STEAL_MS": str(steal_ms)}) for node in self.nodes]
        self.finished = 0
        for node, worker in zip(self.nodes, self.workers):
            wait_for(lambda: self.redis.exists(self.keys.worker(node)) or not worker.alive(),
                     300, f"worker {node} to start")
            worker.check()

    def stats(self) -> list[dict[str, Any]]:
        raws = [self.redis.hget(self.keys.worker(node), "stats") for node in self.nodes]
        return [loads(raw) if raw else {} for raw in raws]

    def settled(self) -> list[dict[str, Any]]:
        """Both workers' stats once their heartbeats count every job finished."""
        found: list[dict[str, Any]] = wait_for(
            lambda: (s := self.stats()) and sum(sum(w.get("jobs", {}).values())
                                                for w in s) >= self.finished and s,
            30, "the workers' heartbeats to count every job")
        return found

    def run(self, jobs: list[Job], tick: Tick) -> dict[str, Any]:
        before = self.settled()
        redis0 = sample(self.redis)
        ids = [self.client.submit(j.prompt, max_new_tokens=j.max_new_tokens, temperature=0.0)
               for j in jobs]
        for job_id in ids:
            self.client.wait(job_id, timeout=3600)
            tick(1)
        redis1 = sample(self.redis)
        self.finished += len(ids)
        after = self.settled()
        figures = _figures(self, ids, before, after)
        # The Redis's commands of the run (the other fleet's idle workers' among them).
        spent = cost(redis0, redis1, sum(figures["tokens_by_worker"].values()))
        figures["redis_commands_per_token"] = spent["redis_commands_per_token"]
        return figures

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.client.close()
        self.redis.close()


def _figures(pair: Pair, ids: list[str], before: list[dict[str, Any]],
             after: list[dict[str, Any]]) -> dict[str, Any]:
    pipe = pair.redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(pair.keys.job(job_id), "created_at", "started_at", "first_token_at",
                   "finished_at", "worker", "owner", "token_ids")
    rows = [[v.decode() if v else None for v in row] for row in pipe.execute()]
    tags = {owner_tag(node): node for node in pair.nodes}
    tokens = dict.fromkeys(pair.nodes, 0)
    ttft, waits_placed, stolen = [], [], 0
    for created, started, first, _finished, worker, owner, token_ids in rows:
        if worker in tokens:
            tokens[worker] += len(loads(token_ids or "[]"))
        if created and first:
            ttft.append((float(first) - float(created)) * 1000)
        if owner and created and started:
            waits_placed.append((float(started) - float(created)) * 1000)
            stolen += tags.get(owner) != worker
    span = (max(float(r[3]) for r in rows if r[3]) - min(float(r[0]) for r in rows if r[0]))
    counters = {c: sum(a.get(c, 0) - b.get(c, 0) for a, b in zip(after, before))
                for c in COUNTERS}
    shares = sorted(tokens.values())
    return {
        "tokens_per_s": round(sum(tokens.values()) / span, 1) if span > 0 else None,
        "ttft_p50_ms": _rounded(percentile(ttft, 50)),
        "hit_rate": (round(counters["prefix_hit_tokens"] / counters["prefix_query_tokens"], 3)
                     if counters["prefix_query_tokens"] else None),
        **counters,
        "tokens_by_worker": tokens,
        "busy_balance": round(shares[0] / shares[-1], 3) if shares[-1] else None,
        "placed_jobs": len(waits_placed), "stolen_jobs": stolen,
        "placed_wait_p99_ms": _rounded(percentile(waits_placed, 99)),
        "placed_wait_max_ms": round(max(waits_placed), 1) if waits_placed else None,
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def run(env: BenchEnv, model: str, batch: int, jobs: int, max_new_tokens: int,
        rounds: int, steal_ms: int, phase: Phase) -> dict[str, Any]:
    """Both fleets on the shared-prefix load and on one hot prefix, ``rounds``
    rounds of ``jobs`` jobs each, taking turns; the medians of each."""
    loads_ = {"shared": 0.0, "hot": HOT}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        load: {name: [] for name in FLEETS} for load in loads_}
    with ExitStack() as stack:
        pairs = {}
        for name, affinity in FLEETS.items():
            with phase(f"placement {name} c={batch}: starting", 1):
                pairs[name] = stack.enter_context(closing(Pair(
                    env, f"place-{name}-c{batch}", model, batch, affinity, steal_ms)))
        for name, pair in pairs.items():
            warm = shared_prefix(jobs, 2, seed=WARM_SEED, system_seed=0)
            with phase(f"placement {name}: warm-up", len(warm)) as tick:
                pair.run(warm, tick)
        for r in range(rounds):
            for load, hot in loads_.items():
                round_jobs = shared_prefix(jobs, max_new_tokens, seed=r, system_seed=0, hot=hot)
                for name, pair in pairs.items():
                    with phase(f"placement {name} {load} ({r + 1}/{rounds})",
                               len(round_jobs)) as tick:
                        runs[load][name].append(pair.run(round_jobs, tick))
    out: dict[str, Any] = {"rounds": rounds, "jobs": jobs, "batch": batch, "steal_ms": steal_ms}
    for load, by_fleet in runs.items():
        out[load] = {name: _medians(rs) for name, rs in by_fleet.items()}
    return out


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if not isinstance(value, dict):
            values = [r[key] for r in runs if r.get(key) is not None]
            out[key] = round(statistics.median(values), 3) if values else None
    out["placed_wait_max_ms"] = max((r["placed_wait_max_ms"] or 0 for r in runs), default=None)
    out["tokens_by_worker"] = runs[-1]["tokens_by_worker"]  # the last round's
    return out


def lines(f: dict[str, Any]) -> Iterator[str]:
    """The figures as the bench prints them."""
    yield (f"placement by prefix, 2 workers, batch {f['batch']}, {f['jobs']} jobs, median of "
           f"{f['rounds']} round(s), steal after {f['steal_ms']} ms:")
    for name in FLEETS:
        s = f["shared"][name]
        yield (f"  shared prefixes, {name:<7}: hit rate {num(s['hit_rate'], 3)}, TTFT p50 "
               f"{num(s['ttft_p50_ms'], 1)} ms, {num(s['tokens_per_s'])} tokens/s, "
               f"{num(s['redis_commands_per_token'], 3)} Redis commands per token")
    for name in FLEETS:
        h = f["hot"][name]
        yield (f"  one hot prefix,  {name:<7}: hit rate {num(h['hit_rate'], 3)}, TTFT p50 "
               f"{num(h['ttft_p50_ms'], 1)} ms, {num(h['tokens_per_s'])} tokens/s, "
               f"worker balance {num(h['busy_balance'], 3)}, placed {num(h['placed_jobs'])}, "
               f"stolen {num(h['stolen_jobs'])}, placed jobs' wait to start p99 "
               f"{num(h['placed_wait_p99_ms'], 1)} ms, max {num(h['placed_wait_max_ms'], 1)} ms")

