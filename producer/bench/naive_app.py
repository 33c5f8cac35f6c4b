"""The pattern people write first, for comparison: one Celery task per prompt.

``celery -A tokenfleet.bench.naive_app worker -P solo``: each task runs
``model.generate()`` on its one prompt and returns the text through Celery's
Redis result backend; ``worker_prefetch_multiplier=1``, JSON only. ``noop``
takes the same request and does nothing, to measure Celery's own cost per job.
The worker reads the same ``TOKENFLEET_*`` settings as the fleet's (Redis URL,
namespace, model, device, torch threads).
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery

from tokenfleet.shared.settings import Settings, get_settings

GENERATE = "naive.generate"
NOOP = "naive.noop"

_loaded: tuple[Any, Any] | None = None


def make_app(redis_url: str, namespace: str) -> Celery:
    from tokenfleet.workers.app import broker_ssl

    naive = Celery("tokenfleet-naive")
    prefix = {"global_keyprefix": f"{namespace}:naive:"}
    naive.conf.update(
        broker_url=redis_url,
        result_backend=redis_url,
        broker_use_ssl=broker_ssl(redis_url),
        redis_backend_use_ssl=broker_ssl(redis_url),
        broker_transport_options=prefix,
        result_backend_transport_options=prefix,
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        worker_prefetch_multiplier=1,
        worker_send_task_events=False,
        result_expires=3600,
        worker_cancel_long_running_tasks_on_connection_loss=True,
    )
    naive.task(name=GENERATE)(generate)
    naive.task(name=NOOP)(noop)
    return naive


def _model(settings: Settings) -> tuple[Any, Any]:
    """Loaded once per worker process, on its first task (the bench warms it up)."""
    global _loaded
    if _loaded is None:
        import torch

        from tokenfleet.shared import models
        from tokenfleet.workers.build import cpu_threads

        if settings.device == "cpu" or settings.torch_threads:
            torch.set_num_threads(cpu_threads(settings))
        _loaded = models.load(settings.model, settings.device, settings.dtype)
    return _loaded


def generate(prompt: str, max_new_tokens: int) -> dict[str, Any]:
    import torch

    started = time.time()
    model, tokenizer = _model(get_settings())
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return {"text": tokenizer.decode(new, skip_special_tokens=True), "num_tokens": len(new),
            "started_at": started, "finished_at": time.time()}


def noop(prompt: str, max_new_tokens: int) -> dict[str, Any]:
    return {"text": "", "num_tokens": 0}


_settings = get_settings()
app = make_app(_settings.redis_url, _settings.namespace)
