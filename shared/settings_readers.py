"""Which process reads each setting, for the settings reference (docs/hooks/settings.py).

A setting changes nothing in a process that does not read it: a worker's
``TOKENFLEET_MODEL`` is not a client's business, and a gateway's timeouts mean
nothing to a worker. "client" is whatever submits through ``FleetClient``
(a backend, ``tokenfleet submit``, ``status``, the gateway's own client).
Limits are the worker's, which publishes them with its heartbeat; a client's
own value can only be stricter.
"""

from __future__ import annotations

ALL = "client, gateway, worker"
CLIENT = "client, gateway"
GATEWAY = "gateway"
WORKER = "worker"
LIMIT = "worker (published to clients)"
# Read where webhooks are delivered: each gateway, and `tokenfleet webhooks deliver`.
DELIVERER = "gateway, webhooks deliver"
# Checked by each process against its own value: a worker re-checks what a client sent.
EACH = "client, gateway, worker (each checks its own)"

READ_BY: dict[str, str] = {
    "redis_url": ALL,
    "namespace": ALL,
    "model": WORKER,
    "queue": WORKER,
    "device": WORKER,
    "dtype": WORKER,
    "torch_threads": WORKER,
    "host_workers": WORKER,
    "engine": WORKER,
    "gpus_per_worker": WORKER,
    "vllm_cpu_kv_cache_bytes": WORKER,
    "gpu_sim_step_ms": WORKER,
    "async_scheduling": WORKER,
    "gil_switch_ms": WORKER,
    "kv_cache": WORKER,
    "prefix_cache": WORKER,
    "max_step_tokens": WORKER,
    "cpu_packed_linear": WORKER,
    "max_batch": WORKER,
    "prefetch": WORKER,
    "block_ms": WORKER,
    "fair_share": WORKER,
    "tenant_weights": WORKER,
    "fair_share_burst_tokens": WORKER,
    "preempt_batch": WORKER,
    "require_worker": CLIENT,
    "no_worker_grace_s": CLIENT,
    "max_queue": LIMIT,
    "max_prompt_chars": EACH,
    "max_prompt_tokens": LIMIT,
    "max_new_tokens_limit": LIMIT,
    "max_payload_bytes": LIMIT,
    "max_stop_strings": EACH,
    "max_metadata_bytes": EACH,
    "max_n": CLIENT,
    "max_logprob_values": GATEWAY,
    "responses_ttl": GATEWAY,
    "grammar_compile_s": ALL,
    "grammar_cache_mb": WORKER,
    "max_batch_tokens": WORKER,
    "gpu_memory_utilization": WORKER,
    "cpu_memory_fraction": WORKER,
    "cpu_kv_cache_gib": WORKER,
    "metrics_port": WORKER,
    "liveness_s": WORKER,
    "header_timeout_s": GATEWAY,
    "body_timeout_s": GATEWAY,
    "sse_keepalive_s": GATEWAY,
    "gateway_redis_connections": GATEWAY,
    "gateway_redis_wait_s": GATEWAY,
    "gateway_auth": GATEWAY,
    "gateway_key_cache_s": GATEWAY,
    "files_url": CLIENT,
    "batch_window": CLIENT,
    "batch_max_open": CLIENT,
    "files_max_per_tenant": CLIENT,
    "webhook_url": DELIVERER,
    "webhook_secret": DELIVERER,
    "gateway_webhooks": GATEWAY,
    "webhook_retry_s": DELIVERER,
    "webhook_backoff_s": DELIVERER,
    "webhook_backoff_max_s": DELIVERER,
    "webhook_timeout_s": DELIVERER,
    "webhook_concurrency": DELIVERER,
    "webhook_tenant_concurrency": DELIVERER,
    "webhook_tenant_queued": DELIVERER,
    "webhook_tenant_dead": DELIVERER,
    "webhook_allow": "client, gateway, webhooks deliver",
    "max_attempts": WORKER,
    "affinity": ALL,
    "affinity_steal_ms": WORKER,
    "affinity_held": WORKER,
    "affinity_min_chars": CLIENT,
    "claim_idle_s": WORKER,
    "heartbeat_s": WORKER,
    "drain_grace_s": WORKER,
    "max_failed_steps": WORKER,
    "coalesce_ms": WORKER,
    "coalesce_tokens": WORKER,
    "result_ttl_s": "client, gateway, worker",
    "idempotency_ttl_s": CLIENT,
}
