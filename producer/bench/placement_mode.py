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
  to start;
- conversations (``workload.conversations``: ``jobs / 4`` of them, 4 turns, each
  turn's prompt the last one's and more, a turn sent once the one before ended):
  the prefix hit rate, TTFT p50 and tokens/s of the turns after the first.

With 16 system prompts and a batch of jobs in flight, each worker's running
batch holds every system prompt, so scattering loses little there once warm;
a conversation's next turn is one job among many prefixes, cached only where
its last turn ran: the load placement is for.

Times are the records' (Redis's clock): TTFT is created to first token.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, closing
from typing import Any

import redis

from tokenfleet import FleetClient
from tokenfleet.bench.figures import num
from tokenfleet.bench.modes import BenchEnv
from tokenfleet.bench.procs import CeleryProc, wait_for
from tokenfleet.bench.redis_cost import cost, sample
from tokenfleet.bench.workload import Job, arrive, conversations, percentile, shared_prefix
from tokenfleet.shared.settings import get_settings
from tokenfleet.shared.wire.keys import Keys, owner_tag
from tokenfleet.shared.wire.serialization import loads

Tick = Callable[[int], None]
Phase = Callable[[str, int], AbstractContextManager[Tick]]

FLEETS = {"scatter": "false", "placed": "true"}
WORKERS = 2
HOT = 0.8  # the hot load's share of jobs with the first system prompt
WARM_SEED = 1_000_000
TURNS = 4
CONVERSATION_SEED = 2_000_000
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
        ids, t0 = [], time.perf_counter()
        for j in jobs:
            arrive(j, t0)  # --rate
            ids.append(self.client.submit(j.prompt, max_new_tokens=j.max_new_tokens,
                                          temperature=0.0))
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


def _later_turns(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The turns after the first (the first finds nothing cached anywhere) as one run."""
    later = turns[1:] or turns
    counters = {c: sum(t[c] for t in later) for c in COUNTERS}
    tokens = sum(sum(t["tokens_by_worker"].values()) for t in later)
    seconds = sum(sum(t["tokens_by_worker"].values()) / t["tokens_per_s"] for t in later
                  if t["tokens_per_s"])
    return {
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "ttft_p50_ms": statistics.median(t["ttft_p50_ms"] for t in later),
        "hit_rate": (round(counters["prefix_hit_tokens"] / counters["prefix_query_tokens"], 3)
                     if counters["prefix_query_tokens"] else None),
        **counters,
        "first_turn_hit_rate": turns[0]["hit_rate"],
        "placed_jobs": sum(t["placed_jobs"] for t in later),
        "stolen_jobs": sum(t["stolen_jobs"] for t in later),
        "redis_commands_per_token": statistics.median(t["redis_commands_per_token"]
                                                      for t in later),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def run(env: BenchEnv, model: str, batch: int, jobs: int, max_new_tokens: int,
        rounds: int, steal_ms: int, phase: Phase, rate: float | None = None) -> dict[str, Any]:
    """Both fleets on the shared-prefix load and on one hot prefix, ``rounds``
    rounds of ``jobs`` jobs each, taking turns; the medians of each. ``rate``:
    those jobs arrive at this many a second (None: all at once)."""
    loads_ = {"shared": 0.0, "hot": HOT}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        load: {name: [] for name in FLEETS} for load in (*loads_, "conversations")}
    ceilings: list[float] = []
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
                round_jobs = shared_prefix(jobs, max_new_tokens, rate, seed=r, system_seed=0,
                                           hot=hot)
                for name, pair in pairs.items():
                    with phase(f"placement {name} {load} ({r + 1}/{rounds})",
                               len(round_jobs)) as tick:
                        runs[load][name].append(pair.run(round_jobs, tick))
            talks = conversations(max(1, jobs // TURNS), TURNS, max_new_tokens,
                                  seed=CONVERSATION_SEED + r)
            by_turn: dict[str, list[dict[str, Any]]] = {name: [] for name in FLEETS}
            for t, turn in enumerate(talks):
                for name, pair in pairs.items():
                    with phase(f"placement {name} conversations, turn {t + 1} "
                               f"({r + 1}/{rounds})", len(turn)) as tick:
                        by_turn[name].append(pair.run(turn, tick))
            for name, turns in by_turn.items():
                runs["conversations"][name].append(_later_turns(turns))
            ceilings.append(_ceiling(model, talks))
    out: dict[str, Any] = {"rounds": rounds, "jobs": jobs, "batch": batch, "steal_ms": steal_ms,
                           "rate": rate}
    for load, by_fleet in runs.items():
        out[load] = {name: _medians(rs) for name, rs in by_fleet.items()}
    out["conversations"]["ceiling"] = round(statistics.median(ceilings), 3)
    return out


def _ceiling(model: str, talks: list[list[Job]]) -> float:
    """The most of the later turns' prompt tokens a cache can hold: each turn's
    last one's full blocks (its new text, and the last one's partial block,
    are computed wherever it runs)."""
    from transformers import AutoTokenizer

    from tokenfleet.shared import models
    from tokenfleet.workers.paged_cache import BLOCK_SIZE

    tokenizer = AutoTokenizer.from_pretrained(models.resolve(model))
    lengths = [[len(tokenizer(job.prompt).input_ids) for job in turn] for turn in talks]
    cacheable = sum(before // BLOCK_SIZE * BLOCK_SIZE
                    for turn in lengths[:-1] for before in turn)
    return cacheable / max(1, sum(sum(turn) for turn in lengths[1:]))


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if not isinstance(value, dict):
            values = [r[key] for r in runs if r.get(key) is not None]
            out[key] = round(statistics.median(values), 3) if values else None
    if "placed_wait_max_ms" in runs[0]:
        out["placed_wait_max_ms"] = max(r["placed_wait_max_ms"] or 0 for r in runs)
        out["tokens_by_worker"] = runs[-1]["tokens_by_worker"]  # the last round's
    return out


def lines(f: dict[str, Any]) -> Iterator[str]:
    """The figures as the bench prints them."""
    arriving = (f"arriving at {f['rate']:g} a second" if f.get("rate")
                else "submitted at once")
    yield (f"placement by prefix, 2 workers, batch {f['batch']}, {f['jobs']} jobs {arriving}, "
           f"median of {f['rounds']} round(s), steal after {f['steal_ms']} ms:")
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
    for name in FLEETS:
        c = f["conversations"][name]
        yield (f"  conversations, turns 2-{TURNS}, {name:<7}: hit rate {num(c['hit_rate'], 3)} "
               f"of at most {num(f['conversations']['ceiling'], 3)} "
               f"(turn 1: {num(c['first_turn_hit_rate'], 3)}), TTFT p50 "
               f"{num(c['ttft_p50_ms'], 1)} ms, {num(c['tokens_per_s'])} tokens/s, placed "
               f"{num(c['placed_jobs'])}, stolen {num(c['stolen_jobs'])}")

