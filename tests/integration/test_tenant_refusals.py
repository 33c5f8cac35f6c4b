"""Each tenant's refusals, counted by a real gateway in a real redis-server and
read as the metrics exporter serves them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from tokenfleet.exporter.backlog import registry
from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import ApiKey
from tokenfleet.shared.settings import Settings
from tokenfleet.gateway.tenant_refusals import REASONS, reason_of

from gateway_server import gateways, pin_live_worker
from helpers import redis_client, wait_until

pytestmark = pytest.mark.timeout(60)

IDLE = "idle"  # a queue a live worker seems to serve but never reads: its jobs stay queued


@pytest.fixture(scope="module")
def fleet(redis_url: str) -> Iterator[dict[str, Any]]:
    """One gateway asking for keys, the idle queue, and a key maker."""
    settings = Settings(queue="default", redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}")
    r = redis_client(redis_url)
    keys = Keys(settings.namespace)
    pin_live_worker(r, settings.namespace, IDLE)

    def make_key(tenant: str, **limits: Any) -> tuple[str, str]:
        key, key_id = new_key()
        create_key(r, keys, ApiKey(key_id=key_id, tenant=tenant, created_at=time.time(),
                                   **limits), key)
        return key, key_id

    with gateways(settings) as start:
        yield {"r": r, "keys": keys, "make_key": make_key, "http": start(gateway_auth="on")}
    r.close()


def submit(http: httpx.Client, key: str, **body: Any) -> httpx.Response:
    return http.post("/v1/jobs", headers={"Authorization": f"Bearer {key}"},
                     json={"prompt": "hello", "model": IDLE, **body})


def exported(fleet: dict[str, Any]) -> str:
    return generate_latest(registry(fleet["r"], fleet["keys"])).decode()


def exported_with(fleet: dict[str, Any], *lines: str) -> str:
    """The exporter's text once it holds ``lines``: the gateway writes its counts
    after answering, so they are awaited through Redis (bounded)."""
    def ready() -> str | None:
        text = exported(fleet)
        return text if all(line in text for line in lines) else None
    found: str = wait_until(ready, timeout=10, what=f"{lines} in the exporter's text")
    return found


def refusals(tenant: str, reason: str, count: int) -> str:
    return f'tokenfleet_tenant_refusals_total{{reason="{reason}",tenant="{tenant}"}} {count}.0'


def test_the_61st_request_at_rpm_60_is_counted_as_the_tenants_refusal(
        fleet: dict[str, Any]) -> None:
    key, key_id = fleet["make_key"]("acme", rpm=60)
    for _ in range(60):
        assert submit(fleet["http"], key).status_code == 202
    assert submit(fleet["http"], key).status_code == 429
    text = exported_with(fleet, refusals("acme", "requests", 1))
    assert text.count('tenant="acme"') == 1, text  # nothing else of acme's was refused
    assert key not in text and key_id not in text  # neither the key nor its id


def test_each_refusal_counts_under_its_reason_and_the_keys_tenant(
        fleet: dict[str, Any]) -> None:
    http = fleet["http"]
    elsewhere, _ = fleet["make_key"]("globex", queues=["elsewhere"])
    assert submit(http, elsewhere).status_code == 403  # a queue the key may not use
    key, _ = fleet["make_key"]("globex", tpm=100)
    assert submit(http, key, sampling={"max_new_tokens": 200}).status_code == 429  # > tpm
    assert submit(http, key, sampling={"top_p": 7}).status_code == 422  # a field's limit
    assert submit(http, key, tenant="acme").status_code == 400  # the fleet's own validation
    # Without a key there is no tenant: a 401 is counted nowhere.
    assert http.post("/v1/jobs", json={"model": IDLE}).status_code == 401
    text = exported_with(fleet, refusals("globex", "queue_not_allowed", 1),
                         refusals("globex", "oversize", 1), refusals("globex", "invalid", 2))
    assert text.count('tenant="globex"') == 3, text
    assert 'tenant="default"' not in text and 'tenant=""' not in text, text


def test_every_named_reason_is_one_of_a_counted_status() -> None:
    # A reason whose refusal's status were not counted would never be exported.
    for refusal, reason in REASONS.items():
        assert reason_of(refusal.status, refusal) == reason
    assert reason_of(404, None) is None and reason_of(401, None) is None


def test_a_tenant_queue_full_refusal_gives_its_tokens_back(fleet: dict[str, Any]) -> None:
    key, _ = fleet["make_key"]("initech", tpm=1000, max_queued=1)
    http = fleet["http"]
    first = submit(http, key, sampling={"max_new_tokens": 10})
    assert first.status_code == 202
    left = first.headers["x-ratelimit-remaining-tokens"]
    assert submit(http, key, sampling={"max_new_tokens": 10}).status_code == 429
    # Nothing was enqueued: the tpm budget is where the first request left it.
    now = http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert now.headers["x-ratelimit-remaining-tokens"] == left
    exported_with(fleet, refusals("initech", "tenant_queue_full", 1))
