"""Build a ready worker from settings: load the model, make the runner."""

from __future__ import annotations

import logging
import os
from typing import Any

from tokenfleet.shared import models
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.null_runner import NULL_MODEL, NullRunner, null_tokenizer
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.service import Worker

log = logging.getLogger(__name__)


def cpu_threads(settings: Settings) -> int:
    """Torch's intra-op threads on the CPU. Left to itself torch takes every core,
    and two processes (or a worker and a busy Redis) spinning on the same cores
    run a hundred times slower than one thread each; so by default a CPU worker
    takes half the cores."""
    return settings.torch_threads or max(1, (os.cpu_count() or 2) // 2)


def build_worker(settings: Settings, name: str, redis: Any = None) -> Worker:
    if settings.model == NULL_MODEL:
        # No model at all (``tokenfleet bench``'s overhead mode): the fleet's own cost.
        tokenizer = null_tokenizer()
        null = NullRunner(tokenizer)
        log.info("serving with the null runner: no model, one fixed token per step")
        return Worker(settings, null, tokenizer, name=name, eos_token_ids=null.eos_token_ids,
                      max_model_len=null.max_model_len, redis=redis)

    import torch

    if settings.device == "cpu" or settings.torch_threads:
        torch.set_num_threads(cpu_threads(settings))
    model, tokenizer = models.load(settings.model, settings.device, settings.dtype)
    runner = HFRunner(model, tokenizer)
    log.info("loaded model %s on %s (%d threads)", settings.model, settings.device,
             torch.get_num_threads())
    return Worker(settings, runner, tokenizer, name=name, eos_token_ids=runner.eos_token_ids,
                  max_model_len=runner.max_model_len, redis=redis)
