"""The Celery app: ``celery -A tokenfleet.workers.app worker -P solo -c 1 -n tiny-gpu0@%h``.

Celery gives the fleet its process model, node names, remote control and
monitoring events; the jobs themselves flow through the engine's own stream
(see ``tokenfleet.workers.feeder``), not through Celery tasks. Only JSON is accepted.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import parse_qs, urlparse

from celery import Celery

from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.redis.connect import broker_url, node_url
from tokenfleet.shared.settings import get_settings
from tokenfleet.workers.bootstep import EngineStep

_settings = get_settings()
_celery_prefix = Keys(_settings.namespace).celery_prefix

CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def broker_ssl(url: str) -> dict[str, Any] | None:
    """Celery's TLS options for a ``rediss://`` URL, from the same query parameters
    redis-py reads (``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``),
    so one URL configures the clients, the workers and Celery alike."""
    parts = urlparse(url)
    if parts.scheme != "rediss":
        return None
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    options: dict[str, Any] = {"ssl_cert_reqs": CERT_REQS[query.get("ssl_cert_reqs", "required")]}
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in query:
            options[name] = query[name]
    return options


app = Celery("tokenfleet")
app.conf.update(
    # On a Redis Cluster, the node that holds Celery's keys (redis_conn.broker_url).
    broker_url=broker_url(_settings.redis_url, _celery_prefix),
    broker_connection_retry_on_startup=True,
    # An error reply to Celery's connection (CLUSTERDOWN while a cluster comes
    # back from a restart, READONLY, OOM; Kombu already took LOADING for a lost
    # connection) reconnects with backoff, as a refused connection does, instead
    # of shutting the worker down: the fleet's own writes ride out the same
    # states (publisher.is_transient).
    broker_channel_error_retry=True,
    broker_use_ssl=broker_ssl(node_url(_settings.redis_url)),
    broker_transport_options={"global_keyprefix": _celery_prefix},
    task_serializer="json",
    result_serializer="json",
    event_serializer="json",
    accept_content=["json"],
    result_accept_content=["json"],
    worker_prefetch_multiplier=1,
    worker_send_task_events=False,
    # Celery 6's default, set now to silence its deprecation warning on a lost broker.
    worker_cancel_long_running_tasks_on_connection_loss=True,
)
app.steps["worker"].add(EngineStep)

import tokenfleet.workers.celery_quiet  # noqa: E402  (Celery's output; a quick exit)
import tokenfleet.workers.control  # noqa: E402,F401  (registers the inspect/control commands)
