"""Build a ready worker from settings: its engine by name, and the built-in
engine's factory (``hf``: load the model, pick the runner for its KV cache).

Engines are found through the ``tokenfleet.engines`` entry points
(``tokenfleet.workers.engines``); ``build_hf`` is the one tokenfleet's own
metadata registers as ``hf``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenfleet.shared import models
from tokenfleet.shared.settings import Settings, get_settings
from tokenfleet.workers import budget, cpu_linear, engines
from tokenfleet.workers.engines import BuiltEngine
from tokenfleet.workers.health import StatusServer
from tokenfleet.workers.hf_engine import HFEngine, ModelRunner
from tokenfleet.workers.null_runner import NULL_MODEL, NullRunner, null_tokenizer
from tokenfleet.workers.paged_runner import PagedRunner
from tokenfleet.workers.runner import HFRunner, not_plain_attention
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.service import Worker

if TYPE_CHECKING:
    from tokenfleet.workers.grammar import Grammars

log = logging.getLogger(__name__)


def cpu_threads(settings: Settings) -> int:
    """Torch's intra-op threads on the CPU: ``settings.torch_threads`` if set,
    else this host's usable cores but one, shared among its worker processes
    (``host_workers``): one thread alone on two cores, seven on eight, three
    each for four workers on sixteen.

    The core left over is for what runs beside torch: each worker's feeder,
    publisher and heartbeat (Python, under the GIL), the OS, and on a small host
    Redis or the gateway. torch's threads spin at every op's end waiting for
    each other, so one of them descheduled by that work stalls the whole op
    (vLLM's CPU backend keeps a core for its front end likewise). A host that
    runs nothing but one worker of a compute-bound model can give it every core
    with TOKENFLEET_TORCH_THREADS."""
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


def build_worker(settings: Settings, name: str, redis: Any = None,
                 status: StatusServer | None = None) -> Worker:
    engine, tokenizer, settings = build_engine(settings)
    return Worker(settings, engine, tokenizer, name=name, redis=redis, status=status)


def build_engine(settings: Settings) -> BuiltEngine:
    """The engine the settings name (``settings.engine``, looked up in the
    ``tokenfleet.engines`` entry points: ``UnknownEngine`` if none has that
    name), the tokenizer its jobs are admitted by, and the settings with the
    batch sizes left at "auto" sized for it.

    The null model (``TOKENFLEET_MODEL=null``) is no model at all: whatever
    the engine setting, the built-in engine serves it with the null runner, so
    ``tokenfleet bench`` measures the fleet's own cost the same way each time."""
    if settings.model == NULL_MODEL:
        return build_hf(settings)
    return engines.factory(settings.engine)(settings)


def build_hf(settings: Settings) -> BuiltEngine:
    """The built-in engine's factory (``hf``): the model loaded on the
    settings' device, its runner (``model_runner``), the scheduler set up for
    what that runner's KV cache can do."""
    model: Any = None
    runner: ModelRunner
    if settings.model == NULL_MODEL:
        # No model at all (``tokenfleet bench``'s overhead mode): the fleet's own cost.
        tokenizer = null_tokenizer()
        runner = NullRunner(tokenizer)
        log.info("serving with the null runner: no model, one fixed token per step")
    else:
        import torch

        if settings.device == "cpu" or settings.torch_threads:
            torch.set_num_threads(cpu_threads(settings))
        model, tokenizer = models.load(settings.model, settings.device, settings.dtype)
        runner = model_runner(settings, model, tokenizer)
        log.info("loaded model %s on %s (%d threads, %s)", settings.model, settings.device,
                 torch.get_num_threads(), type(runner).__name__)
    settings = budget.apply(settings, budget.resolve(settings, model, runner.max_model_len,
                                                     rows_at_longest=runner.rows_at_longest))
    engine = hf_engine(settings, runner, runner.eos_token_ids, runner.max_model_len)
    if isinstance(runner, NullRunner):
        # It makes a fixed token without sampling: no log probabilities to report
        # (such jobs are refused, naming the field), no logits to mask.
        engine.reports_logprobs = False
    else:
        engine.grammars = grammars(tokenizer, runner.vocab_size, runner.eos_token_ids, settings)
    return BuiltEngine(engine, tokenizer, settings)


def grammars(tokenizer: Any, vocab_size: int, eos_token_ids: set[int],
             settings: Settings | None = None) -> Grammars | None:
    """Structured output's compiler for this model, within the settings' budget
    and cache bound (the process's, unless given), or None without xgrammar
    (the engine then refuses such jobs, naming what to install)."""
    try:
        from tokenfleet.workers.grammar import Grammars
    except ImportError:
        log.warning("xgrammar is not installed (the structured extra): jobs asking for "
                    "structured output are refused")
        return None
    limits = settings or get_settings()
    return Grammars(tokenizer, vocab_size, eos_token_ids, budget_s=limits.grammar_compile_s,
                    cache_bytes=limits.grammar_cache_mb * 2**20)


def model_runner(settings: Settings, model: Any, tokenizer: Any) -> HFRunner | PagedRunner:
    """The runner over the KV cache the settings ask for (the rectangular one for
    a model the paged attention does not serve), its linear layers packed for
    oneDNN on the CPU unless the settings say not to (in place, once)."""
    if settings.cpu_packed_linear:
        cpu_linear.pack(model)
    if settings.kv_cache == "paged":
        why = not_plain_attention(model)
        if why is None:
            return PagedRunner(model, tokenizer, prefix_cache=settings.prefix_cache)
        log.warning("%s: %s; serving it with the rectangular KV cache", settings.model, why)
    return HFRunner(model, tokenizer)


def hf_engine(settings: Settings, runner: ModelRunner, eos_token_ids: set[int],
              max_model_len: int) -> HFEngine:
    """The built-in engine around ``runner``; ``settings`` with numbers for the
    batch sizes. A runner that chunks its prefills gets steps of at most
    ``max_step_tokens`` (but one token for each of ``max_batch`` decodes)."""
    max_batch, max_batch_tokens = budget.resolved(settings)
    if isinstance(runner, PagedRunner):  # cached prefixes stay while the budget holds them
        runner.cache.keep_blocks = max_batch_tokens // runner.cache.block_size
    scheduler = Scheduler(max_batch, eos_token_ids, max_model_len,
                          max_failures=settings.max_attempts, max_batch_tokens=max_batch_tokens,
                          max_prefill_tokens=settings.max_step_tokens,
                          max_step_tokens=(max(settings.max_step_tokens, max_batch)
                                           if runner.chunked_prefill else None),
                          cached=getattr(runner, "cached_prefix", None))
    return HFEngine(scheduler, runner, max_failed_steps=settings.max_failed_steps,
                    vocab_size=runner.vocab_size)
