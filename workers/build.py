"""Build a ready worker from settings: load the model, make its engine."""

from __future__ import annotations

import logging
import os
from typing import Any

from tokenfleet.shared import models
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.engine import Engine
from tokenfleet.workers.hf_engine import HFEngine, Runner
from tokenfleet.workers.null_runner import NULL_MODEL, NullRunner, null_tokenizer
from tokenfleet.workers.paged_runner import PagedRunner, unsupported
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.service import Worker

log = logging.getLogger(__name__)


def cpu_threads(settings: Settings) -> int:
    """Torch's intra-op threads on the CPU. Left to itself torch takes every core,
    and two processes (or a worker and a busy Redis) spinning on the same cores
    run a hundred times slower than one thread each; so by default a CPU worker
    takes half the cores."""
    return settings.torch_threads or max(1, (os.cpu_count() or 2) // 2)


def build_worker(settings: Settings, name: str, redis: Any = None) -> Worker:
    engine, tokenizer = build_engine(settings)
    return Worker(settings, engine, tokenizer, name=name, redis=redis)


def build_engine(settings: Settings) -> tuple[Engine, Any]:
    """The engine the settings ask for, with the tokenizer its jobs are admitted by."""
    if settings.model == NULL_MODEL:
        # No model at all (``tokenfleet bench``'s overhead mode): the fleet's own cost.
        tokenizer = null_tokenizer()
        null = NullRunner(tokenizer)
        log.info("serving with the null runner: no model, one fixed token per step")
        return hf_engine(settings, null, null.eos_token_ids, null.max_model_len), tokenizer
    if settings.engine == "vllm":
        from tokenfleet.workers.vllm_engine import VLLMEngine

        return VLLMEngine.build(settings)

    import torch

    if settings.device == "cpu" or settings.torch_threads:
        torch.set_num_threads(cpu_threads(settings))
    model, tokenizer = models.load(settings.model, settings.device, settings.dtype)
    runner = model_runner(settings, model, tokenizer)
    log.info("loaded model %s on %s (%d threads, %s KV cache)", settings.model, settings.device,
             torch.get_num_threads(), settings.kv_cache)
    return hf_engine(settings, runner, runner.eos_token_ids, runner.max_model_len), tokenizer


def model_runner(settings: Settings, model: Any, tokenizer: Any) -> HFRunner | PagedRunner:
    """The runner over the KV cache the settings ask for (the rectangular one for
    a model the paged attention does not serve)."""
    if settings.kv_cache == "paged":
        why = unsupported(model)
        if why is None:
            return PagedRunner(model, tokenizer)
        log.warning("%s: %s; serving it with the rectangular KV cache", settings.model, why)
    return HFRunner(model, tokenizer)


def hf_engine(settings: Settings, runner: Runner, eos_token_ids: set[int],
              max_model_len: int) -> HFEngine:
    chunked = isinstance(runner, PagedRunner)  # the rectangular cache runs whole prefills
    scheduler = Scheduler(settings.max_batch, eos_token_ids, max_model_len,
                          max_failures=settings.max_attempts,
                          max_batch_tokens=settings.max_batch_tokens,
                          max_step_tokens=(max(settings.max_step_tokens, settings.max_batch)
                                           if chunked else None))
    return HFEngine(scheduler, runner, max_failed_steps=settings.max_failed_steps)
