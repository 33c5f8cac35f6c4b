"""What the fleet asks of Redis: commands and CPU per generated token, and how many
tokens per second one Redis absorbs from K no-model workers at batch B.

- ``sample`` / ``cost``: Redis's own counters (``INFO commandstats``, ``INFO cpu``)
  before and after a run; their difference over the run's tokens. Commands run
  inside a Lua script count one each, as Redis counts them (the script call too).
- ``absorb``: the sweep. K worker processes with the null runner (no model: a
  token per job per step at once) share one queue on one Redis; their intake is
  paused while the jobs are queued, then let go. Tokens per second over the
  run, Redis's CPU against the wall clock (1.0: one core, all Redis has for
  commands), and what that makes per token. A sweep over K stops once adding
  workers no longer adds tokens per second: Redis, or the machine, is full.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.settings import get_settings
from tokenfleet.bench.procs import BenchError, CeleryProc, Control, cpu_seconds, wait_for
from tokenfleet.bench.taps import EventTap
from tokenfleet.workers.null_runner import NULL_MODEL

# The target: at batch 64, at most this many Redis commands per token.
COMMANDS_PER_TOKEN = {64: 0.3}
# A point is Redis-bound when Redis's CPU reaches this share of a core.
SATURATED_BUSY = 0.9
# Adding workers that add less than this share of tokens per second: saturated.
LEAST_GAIN = 0.05
ABSORB_TOKENS_PER_JOB = 512  # long jobs: the per-token cost, not the per-job cost


# -- Redis's counters -----------------------------------------------------------


@dataclass(frozen=True)
class RedisSample:
    """Redis's counters at one moment: calls by command, CPU seconds, bytes in
    and out over the network, wall clock."""

    calls: dict[str, int]
    cpu_s: float
    at: float
    net_bytes: int = 0


def sample(client: redis.Redis) -> RedisSample:
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    net = client.info("stats")
    calls = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    return RedisSample(calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                       time.perf_counter(),
                       int(net["total_net_input_bytes"]) + int(net["total_net_output_bytes"]))


def cost(before: RedisSample, after: RedisSample, tokens: int) -> dict[str, Any]:
    """Commands and CPU between two samples, per generated token. The samples'
    own INFO calls are left out."""
    calls = {name: n - before.calls.get(name, 0) for name, n in after.calls.items()
             if name != "info"}
    calls = {name: n for name, n in calls.items() if n > 0}
    total = sum(calls.values())
    cpu = after.cpu_s - before.cpu_s
    per = max(1, tokens)
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:8]
    return {
        "redis_commands": total,
        "redis_commands_per_token": round(total / per, 4),
        "redis_cpu_s_per_1k_tokens": round(cpu / per * 1000, 5),
        # Both directions, pub/sub deliveries to every subscriber included.
        "redis_net_bytes_per_token": round((after.net_bytes - before.net_bytes) / per, 1),
        "redis_commands_per_token_by_name": {name: round(n / per, 4) for name, n in top},
    }


# -- the sweep ----------------------------------------------------------------------


class Pool:
    """``workers`` null-runner worker processes on one namespace (one queue), a
    client that submits, and a tap that hears every job's end."""

    def __init__(self, env: Any, label: str, workers: int, max_batch: int) -> None:
        self.namespace = env.namespace(label)
        self.keys = Keys(self.namespace)
        self.url = env.redis_url
        self.nodes = [f"{label}-{i}@bench" for i in range(workers)]
        self.redis = redis.Redis.from_url(env.redis_url)
        self._stack = ExitStack()
        self._ended = 0
        self._target = 0
        self._last_end = 0.0
        self._done = threading.Event()
        try:
            self.tap = self._stack.enter_context(closing(EventTap(self.url, self.keys,
                                                                  record=False)))
            self.tap.on_end = self._on_end
            self.client = self._stack.enter_context(FleetClient(
                self.url, namespace=self.namespace,
                settings=get_settings().model_copy(update={"require_worker": False})))
            worker_env = env.worker_env(self.namespace, NULL_MODEL, max_batch)
            self.procs = [self._stack.enter_context(closing(
                CeleryProc("tokenfleet.workers.app", node, worker_env))) for node in self.nodes]
            for node, proc in zip(self.nodes, self.procs):
                wait_for(lambda: self.redis.exists(self.keys.worker(node)) or not proc.alive(),
                         300, f"worker {node} to start")
                proc.check()
            self._control = self._stack.enter_context(closing(Control(self.url, self.keys)))
        except BaseException:
            self.close()
            raise

    def _on_end(self, job_id: bytes) -> None:  # on the tap's thread
        self._ended += 1
        self._last_end = time.perf_counter()
        if self._ended >= self._target:
            self._done.set()

    def broadcast(self, command: str, nodes: list[str]) -> None:
        """``control command`` to ``nodes``; asked again, up to three times, of
        those that did not answer (a worker busy on a loaded machine)."""
        self._control.send(command, nodes, tries=3)

    def run(self, active: int, jobs: int, tokens_per_job: int,
            block_s: float = 0.3) -> dict[str, Any]:
        """``jobs`` jobs of ``tokens_per_job`` tokens through the first ``active``
        workers, from a full queue; the figures of the run."""
        self.broadcast("drain", self.nodes)
        # A read already blocked in XREADGROUP when the drain came returns
        # within the worker's block time: after it, nothing is taken early.
        time.sleep(block_s)
        self._ended, self._target = 0, jobs
        self._done.clear()
        for _ in range(jobs):
            self.client.submit("absorb", max_new_tokens=tokens_per_job, temperature=0.0)
        pids = [p.pid for p in self.procs[:active]]
        before, cpu0 = sample(self.redis), sum(cpu_seconds(pid) for pid in pids)
        self.broadcast("resume", self.nodes[:active])
        deadline = time.monotonic() + 600
        while not self._done.wait(1.0):
            for proc in self.procs:
                proc.check()
            if time.monotonic() > deadline:
                raise BenchError(f"absorb: {self._ended}/{jobs} jobs ended in 600 s")
        after, cpu1 = sample(self.redis), sum(cpu_seconds(pid) for pid in pids)
        elapsed = self._last_end - before.at
        tokens = jobs * tokens_per_job
        busy = (after.cpu_s - before.cpu_s) / max(1e-9, after.at - before.at)
        figures = {"workers": active, "batch": None, "jobs": jobs, "tokens": tokens,
                   "elapsed_s": round(elapsed, 3),
                   "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else 0.0,
                   "redis_busy": round(busy, 3),
                   "tokens_per_redis_cpu_s": round(tokens / max(1e-9, after.cpu_s - before.cpu_s)),
                   "worker_cpu_s_per_1k_tokens": round((cpu1 - cpu0) / tokens * 1000, 4)}
        figures.update(cost(before, after, tokens))
        return figures

    def close(self) -> None:
        self._stack.close()
        self.redis.close()


def absorb(env: Any, batches: list[int], workers: list[int], tokens: int,
           phase: Any) -> dict[str, Any]:
    """The sweep: for each batch size, K = each of ``workers`` (ascending) until
    tokens per second stop growing or Redis is busy; ``tokens`` per point.
    ``phase(label, total)`` is the progress bar's context manager."""
    rows: list[dict[str, Any]] = []
    most = max(workers)
    for batch in sorted(set(batches)):
        with phase(f"absorb B={batch}: starting {most} worker(s)", 1):
            pool = Pool(env, f"absorb-b{batch}", most, batch)
        with closing(pool):
            per_job = min(ABSORB_TOKENS_PER_JOB, max(1, tokens // batch))
            pool.run(1, batch, 2)  # warm: the first steps of a batch shape are slow
            best = 0.0
            for k in sorted(set(workers)):
                jobs = max(2 * k * batch, -(-tokens // per_job))
                with phase(f"absorb B={batch} K={k}", 1):
                    row = pool.run(k, jobs, per_job)
                row["batch"] = batch
                gain = row["tokens_per_s"] / best - 1 if best else None
                row["saturated"] = bool(row["redis_busy"] >= SATURATED_BUSY
                                        or (gain is not None and gain < LEAST_GAIN))
                rows.append(row)
                best = max(best, row["tokens_per_s"])
                if row["saturated"]:
                    break
    peak = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
    return {"rows": rows, "tokens_per_job": ABSORB_TOKENS_PER_JOB,
            "peak_tokens_per_s": peak["tokens_per_s"] if peak else None,
            "peak_at": {"workers": peak["workers"], "batch": peak["batch"]} if peak else None,
            "tokens_per_redis_cpu_s": max((r["tokens_per_redis_cpu_s"] for r in rows),
                                          default=None)}


# -- what the run tells ----------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The commands-per-token target, for each fleet mode run at its batch size."""
    out = []
    for mode in ("fleet", "overhead"):
        for c, limit in COMMANDS_PER_TOKEN.items():
            value = (results.get(mode, {}).get(str(c)) or {}).get("redis_commands_per_token")
            if value is not None:
                out.append({"target": f"redis commands per token, {mode} at {c}",
                            "value": value, "threshold": f"<= {limit:g}", "met": value <= limit})
    return out


def render(results: dict[str, Any], console: Console) -> None:
    rows = [(mode, c, f) for mode in ("fleet", "overhead")
            for c, f in sorted(results.get(mode, {}).items(), key=lambda kv: int(kv[0]))
            if "redis_commands_per_token" in f]
    if rows:
        table = Table(title="what Redis does per generated token (INFO commandstats / cpu)")
        for name in ("mode", "conc", "tokens", "commands", "cmd/token", "cpu s/1k tok",
                     "net B/token", "most called (per token)"):
            table.add_column(name, justify="left" if name in ("mode", "most called (per token)")
                             else "right")
        for mode, c, f in rows:
            top = ", ".join(f"{n} {v:g}" for n, v in
                            list(f["redis_commands_per_token_by_name"].items())[:4])
            table.add_row(mode, c, f"{f['tokens']:,}", f"{f['redis_commands']:,}",
                          f"{f['redis_commands_per_token']:.3f}",
                          f"{f['redis_cpu_s_per_1k_tokens']:.4f}",
                          f"{f.get('redis_net_bytes_per_token', 0):,.0f}", top)
        console.print(table)
    sweep = results.get("absorb")
    if not sweep:
        return
    table = Table(title=f"one Redis absorbing tokens from K null-runner workers at batch B "
                        f"({sweep['tokens_per_job']}-token jobs, full queue)",
                  caption="redis busy: Redis CPU seconds per second (1.0 = a core); tok per "
                          "redis cpu s: what one fully busy Redis would absorb at this mix")
    for name in ("B", "K", "tokens/s", "redis busy", "tok per redis cpu s", "cmd/token",
                 "redis cpu s/1k tok", "worker cpu s/1k tok", "saturated"):
        table.add_column(name, justify="right")
    for r in sweep["rows"]:
        table.add_row(str(r["batch"]), str(r["workers"]), f"{r['tokens_per_s']:,.0f}",
                      f"{r['redis_busy']:.2f}", f"{r['tokens_per_redis_cpu_s']:,}",
                      f"{r['redis_commands_per_token']:.3f}",
                      f"{r['redis_cpu_s_per_1k_tokens']:.4f}",
                      f"{r['worker_cpu_s_per_1k_tokens']:.4f}",
                      "yes" if r["saturated"] else "")
    console.print(table)
