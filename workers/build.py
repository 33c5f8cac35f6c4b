"""Build a ready worker from settings: load the model, make its engine."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from tokenfleet.shared import models
from tokenfleet.shared.settings import Settings
from tokenfleet.workers import budget, cpu_linear
from tokenfleet.workers.engine import Engine
from tokenfleet.workers.hf_engine import HFEngine, Runner
from tokenfleet.workers.null_runner import NULL_MODEL, NullRunner, null_tokenizer
from tokenfleet.workers.paged_runner import PagedRunner
from tokenfleet.workers.runner import HFRunner, not_plain_attention
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.service import Worker

log = logging.getLogger(__name__)


def cpu_threads(settings: Settings) -> int:
    """Torch's intra-op threads on the CPU: this host's cores but one, shared
    among its worker processes (``host_workers``): one thread alone on two
    cores, seven on eight, three each for four workers on sixteen.

    The core left over is for what runs beside torch: each worker's feeder,
    publisher and heartbeat (Python, under the GIL), the OS, and on a small host
    Redis or the gateway. torch's threads spin at every op's end waiting for
    each other, so one of them descheduled by that work stalls the whole op;
    vLLM's CPU backend keeps a core for its front end for the same reason.
    Measured on two cores with everything on the host (``tokenfleet bench
    --vs-vllm``, issue 13): one thread gave 0.83 / 0.94 of vLLM serve's tokens
    (plain / streamed) on tiny against 0.60 / 0.55 with two, and on the 86M
    shape 223 against 204 tokens/s. On a host that runs nothing but one worker
    of a compute-bound model, TOKENFLEET_TORCH_THREADS can take every core."""
    return settings.torch_threads or max(1, (usable_cores() - 1) // settings.host_workers)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, cpusets),
    or fewer where a cgroup quota (docker --cpus) allows less."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def build_worker(settings: Settings, name: str, redis: Any = None) -> Worker:
    engine, tokenizer, settings = build_engine(settings)
    return Worker(settings, engine, tokenizer, name=name, redis=redis)


def build_engine(settings: Settings) -> tuple[Engine, Any, Settings]:
    """The engine the settings ask for, the tokenizer its jobs are admitted by,
    and the settings with the batch sizes left at "auto" sized for it."""
    if settings.model == NULL_MODEL:
        # No model at all (``tokenfleet bench``'s overhead mode): the fleet's own cost.
        tokenizer = null_tokenizer()
        null = NullRunner(tokenizer)
        log.info("serving with the null runner: no model, one fixed token per step")
        settings = budget.apply(settings, budget.resolve(settings, None, null.max_model_len))
        engine = hf_engine(settings, null, null.eos_token_ids, null.max_model_len)
        return engine, tokenizer, settings
    if settings.engine == "vllm":
        from tokenfleet.workers.vllm_engine import VLLMEngine

        # vLLM sizes its own KV cache; "auto" is its own default of sequences.
        settings = budget.apply(settings, budget.resolve(settings, None, 1))
        vllm_engine, tokenizer = VLLMEngine.build(settings)
        return vllm_engine, tokenizer, settings

    import torch

    if settings.device == "cpu" or settings.torch_threads:
        torch.set_num_threads(cpu_threads(settings))
    model, tokenizer = models.load(settings.model, settings.device, settings.dtype)
    runner = model_runner(settings, model, tokenizer)
    log.info("loaded model %s on %s (%d threads, %s KV cache)", settings.model, settings.device,
             torch.get_num_threads(), "paged" if isinstance(runner, PagedRunner) else "rect")
    settings = budget.apply(settings, budget.resolve(
        settings, model, runner.max_model_len, rows_at_longest=isinstance(runner, HFRunner)))
    engine = hf_engine(settings, runner, runner.eos_token_ids, runner.max_model_len)
    return engine, tokenizer, settings


def model_runner(settings: Settings, model: Any, tokenizer: Any) -> HFRunner | PagedRunner:
    """The runner over the KV cache the settings ask for (the rectangular one for
    a model the paged attention does not serve), its linear layers packed for
    oneDNN on the CPU unless the settings say not to (in place, once)."""
    if settings.cpu_packed_linear:
        cpu_linear.pack(model)
    if settings.kv_cache == "paged":
        why = not_plain_attention(model)
        if why is None:
            return PagedRunner(model, tokenizer)
        log.warning("%s: %s; serving it with the rectangular KV cache", settings.model, why)
    return HFRunner(model, tokenizer)


def hf_engine(settings: Settings, runner: Runner, eos_token_ids: set[int],
              max_model_len: int) -> HFEngine:
    """The built-in engine; ``settings`` with numbers for the batch sizes."""
    max_batch, max_batch_tokens = budget.resolved(settings)
    chunked = isinstance(runner, PagedRunner)  # the rectangular cache runs whole prefills
    scheduler = Scheduler(max_batch, eos_token_ids, max_model_len,
                          max_failures=settings.max_attempts, max_batch_tokens=max_batch_tokens,
                          max_prefill_tokens=settings.max_step_tokens,
                          max_step_tokens=(max(settings.max_step_tokens, max_batch)
                                           if chunked else None))
    return HFEngine(scheduler, runner, max_failed_steps=settings.max_failed_steps)
