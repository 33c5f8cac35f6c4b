"""How much a worker may run at once: its batch size and KV-token bound, from memory.

The KV cache grows by ``kv_bytes_per_token`` (keys and values of every layer)
for each token a running sequence holds. The budget is the memory the worker
may give it: on CUDA a share (``gpu_memory_utilization``) of what the GPU has
free once the model is loaded, on the CPU a share (``cpu_memory_fraction``) of
the available RAM, split among the host's workers and capped
(``cpu_kv_cache_gib``). From it, for the settings left at "auto":

- ``max_batch_tokens``: the tokens the budget holds; the scheduler admits a job
  only while the running jobs' prompts plus ``max_new_tokens`` fit in it;
- ``max_batch``: ``AUTO_MAX_BATCH`` where the cache takes only the tokens held
  (the paged one: ``max_batch_tokens`` alone bounds its memory, and vLLM sizes
  its own); with the rectangular cache (``workers/kv_cache.py``), rows x the
  longest row, the sequences the budget holds each at its longest (the model's
  context, or the prompt and output limits if shorter).

Resolved once, at build time, after the model is loaded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfleet.shared.settings import Settings

log = logging.getLogger(__name__)

# The batch "auto" never exceeds, as vLLM's max_num_seqs: past it a step's
# compute, not memory, is the bound, and every sequence waits on the longest step.
AUTO_MAX_BATCH = 256
GIB = 2**30


@dataclass(frozen=True)
class Budget:
    max_batch: int
    max_batch_tokens: int
    kv_bytes_per_token: int
    memory_bytes: int  # what the KV cache may take; 0 when nothing was measured
    source: str  # where the memory figure came from, for the log


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Keys and values of every layer for one token, from a Hugging Face config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * dtype_bytes


def resolve(settings: Settings, model: Any, max_model_len: int,
            rows_at_longest: bool = False) -> Budget:
    """The batch size and KV-token bound for ``model`` (None: no model, no cache
    of ours); ``rows_at_longest``: every sequence takes the longest one's memory."""
    longest = min(max_model_len, settings.max_prompt_tokens + settings.max_new_tokens_limit)
    if model is None:
        per_token, memory, source = 0, 0, "no model"
        tokens = longest * AUTO_MAX_BATCH
    else:
        param = next(model.parameters())
        per_token = kv_bytes_per_token(model.config, param.element_size())
        memory, source = memory_for_kv(settings, param.device)
        tokens = max(1, memory // per_token)
    fits = tokens // longest if rows_at_longest else AUTO_MAX_BATCH
    max_batch = (settings.max_batch if settings.max_batch != "auto"
                 else max(1, min(AUTO_MAX_BATCH, fits)))
    max_tokens = settings.max_batch_tokens if settings.max_batch_tokens != "auto" else tokens
    return Budget(max_batch, max_tokens, per_token, memory, source)


def apply(settings: Settings, budget: Budget) -> Settings:
    """``settings`` with the budget's numbers in place of its "auto"s."""
    if settings.max_batch == "auto" or settings.max_batch_tokens == "auto":
        log.info("max batch %d sequences, %s KV tokens (%s, %s a token): %s",
                 budget.max_batch, f"{budget.max_batch_tokens:,}",
                 f"{budget.memory_bytes / GIB:.2f} GiB for the KV cache" if budget.memory_bytes
                 else "no KV cache", f"{budget.kv_bytes_per_token:,} B", budget.source)
    return settings.model_copy(update={"max_batch": budget.max_batch,
                                       "max_batch_tokens": budget.max_batch_tokens})


def resolved(settings: Settings) -> tuple[int, int]:
    """(max_batch, max_batch_tokens) of settings whose "auto"s were resolved."""
    if settings.max_batch == "auto" or settings.max_batch_tokens == "auto":
        raise ValueError("max_batch / max_batch_tokens 'auto' is sized from the model's memory "
                         "budget by build_worker (tokenfleet.workers.budget.apply); give numbers "
                         "to make a Worker directly")
    return settings.max_batch, settings.max_batch_tokens


def memory_for_kv(settings: Settings, device: Any) -> tuple[int, str]:
    """(bytes the KV cache may take on ``device``, how they were found)."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return (int(free * settings.gpu_memory_utilization),
                f"{settings.gpu_memory_utilization:.0%} of {free / GIB:.1f} GiB free of "
                f"{total / GIB:.1f} GiB on {torch.cuda.get_device_name(device)}")
    available = available_ram()
    share = int(available * settings.cpu_memory_fraction / settings.host_workers)
    cap = int(settings.cpu_kv_cache_gib * GIB)
    return (min(share, cap),
            f"{settings.cpu_memory_fraction:.0%} of {available / GIB:.1f} GiB available RAM"
            + (f" / {settings.host_workers} workers" if settings.host_workers > 1 else "")
            + (f", capped at {settings.cpu_kv_cache_gib:g} GiB" if share > cap else ""))


def available_ram() -> int:
    """Bytes of RAM this process may still take: the kernel's MemAvailable, or
    less where a cgroup (a container's memory limit) allows less."""
    available = _meminfo_available()
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        available = min(available, max(0, limit - used))
    return available


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _read_int(path: str) -> int | None:
    """A number from a cgroup file; None when absent or "max" (no limit)."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
