"""A job over its worker's own limits (stricter than the client's that queued it)
ends failed with the reason, and its tenant's place is given back: a worker
built from the environment, as a Celery worker is, on a real redis-server."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tokenfleet import FleetClient, JobStatus
from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import ApiKey
from tokenfleet.shared.settings import get_settings

from gateway_server import gateway  # noqa: F401 (a fixture)
from helpers import assert_built_as_in_production, redis_client, wait_until

pytestmark = pytest.mark.timeout(180)


def test_a_job_over_its_workers_own_limits_fails_with_the_reason_and_frees_its_place(
    settings: Any, gateway: Any, loaded_tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenfleet.workers.build import hf_engine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.service import Worker

    # The worker's environment allows 2 stop strings; the gateway's client, 8 (the default).
    for name, value in {"REDIS_URL": settings.redis_url, "NAMESPACE": settings.namespace,
                        "QUEUE": "default", "BLOCK_MS": "20", "HEARTBEAT_S": "0.5", "MAX_BATCH": "8",
                        "MAX_BATCH_TOKENS": "65536", "MAX_STOP_STRINGS": "2"}.items():
        monkeypatch.setenv(f"TOKENFLEET_{name}", value)
    get_settings.cache_clear()
    model, tokenizer = loaded_tiny
    runner = HFRunner(model, tokenizer)
    worker_settings = get_settings()  # as a Celery worker's bootstep reads them
    worker = Worker(worker_settings, hf_engine(worker_settings, runner, runner.eos_token_ids,
                                               runner.max_model_len), tokenizer, name="w@env")
    assert_built_as_in_production(worker)
    assert worker.settings.max_stop_strings == 2
    worker.start()
    r = redis_client(settings.redis_url)
    keys = Keys(settings.namespace)
    key, key_id = new_key()
    create_key(r, keys, ApiKey(key_id=key_id, tenant="acme", created_at=time.time(),
                               max_queued=1), key)
    try:
        wait_until(lambda: r.zscore(keys.queue_workers("default"), "w@env") is not None,
                   timeout=30, what="the worker's first heartbeat")
        http: httpx.Client = gateway()
        auth = {"Authorization": f"Bearer {key}"}
        body = {"prompt": "hi", "model": "default",
                "sampling": {"max_new_tokens": 4, "stop": ["x", "y", "z"]}}
        sent = http.post("/v1/jobs", json=body, headers=auth)
        assert sent.status_code == 202, sent.text
        with FleetClient(settings=settings) as client:
            state = client.wait(sent.json()["id"], timeout=60)
        assert state.status is JobStatus.FAILED, state
        assert "refused by the worker" in str(state.error) and "stop" in str(state.error), state
        # Its place among the tenant's jobs (--max-queued 1) is given back.
        def admitted() -> bool:
            again = http.post("/v1/jobs", json={"prompt": "hi", "model": "default",
                                                "sampling": {"max_new_tokens": 2}},
                              headers=auth)
            return again.status_code == 202
        wait_until(admitted, timeout=30, what="the tenant's place to be given back")
    finally:
        worker.stop(grace_s=0)
        r.close()
        get_settings.cache_clear()
