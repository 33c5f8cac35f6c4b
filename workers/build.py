"""Build a ready worker from settings: load the model, make the runner."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from tokenfleet.shared import models
from tokenfleet.shared.settings import Settings
from tokenfleet.workers import budget
from tokenfleet.workers.null_runner import NULL_MODEL, NullRunner, null_tokenizer
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.service import Worker

log = logging.getLogger(__name__)


def cpu_threads(settings: Settings) -> int:
    """Torch's intra-op threads on the CPU: this host's cores shared among its
    worker processes (``host_workers``), so a worker alone on two cores takes
    both, and two take one each.

    No core is held back for Redis, the feeder or the publisher: they wait on
    I/O and mostly run while the engine thread is between steps, and a worker
    alone on two cores made 1.6 times the tokens with two threads (issue 13,
    the 86M model). What the default cannot see is other work on the host:
    torch's threads spin at every op's end waiting for each other, so one
    thread descheduled stalls the op. With other processes keeping these two
    cores busy (a load average of 3-7), two threads made 0.3-0.9 times the
    tokens of one on the 86M model (the bench taking turns): on such a host,
    or with more than one worker per host outside ``tokenfleet worker``, set
    TOKENFLEET_TORCH_THREADS or TOKENFLEET_HOST_WORKERS."""
    return settings.torch_threads or max(1, usable_cores() // settings.host_workers)


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
    if settings.model == NULL_MODEL:
        # No model at all (``tokenfleet bench``'s overhead mode): the fleet's own cost.
        tokenizer = null_tokenizer()
        null = NullRunner(tokenizer)
        log.info("serving with the null runner: no model, one fixed token per step")
        settings = budget.apply(settings, budget.resolve(settings, None, null.max_model_len))
        return Worker(settings, null, tokenizer, name=name, eos_token_ids=null.eos_token_ids,
                      max_model_len=null.max_model_len, redis=redis)

    import torch

    if settings.device == "cpu" or settings.torch_threads:
        torch.set_num_threads(cpu_threads(settings))
    model, tokenizer = models.load(settings.model, settings.device, settings.dtype)
    runner = HFRunner(model, tokenizer)
    log.info("loaded model %s on %s (%d threads)", settings.model, settings.device,
             torch.get_num_threads())
    settings = budget.apply(settings, budget.resolve(settings, model, runner.max_model_len))
    return Worker(settings, runner, tokenizer, name=name, eos_token_ids=runner.eos_token_ids,
                  max_model_len=runner.max_model_len, redis=redis)
