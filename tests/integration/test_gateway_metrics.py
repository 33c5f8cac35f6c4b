"""The gateway's own /metrics, served by a real uvicorn in front of a real redis-server."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import ApiKey

from gateway_server import gateway  # noqa: F401  (a fixture)
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)


def scrape(http: httpx.Client) -> list[Sample]:
    """Every sample of the gateway's /metrics, asked for without a key."""
    response = http.get("/metrics", headers={"Authorization": ""})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return [s for family in text_string_to_metric_families(response.text)
            for s in family.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_metrics_need_no_key_and_count_requests_by_route_template_status_and_tenant(
        gateway: Any, r: redis.Redis, settings: Any) -> None:
    key, key_id = new_key()
    create_key(r, Keys(settings.namespace),
               ApiKey(key_id=key_id, tenant="acme", created_at=time.time()), key)
    http = gateway(gateway_auth="on")
    assert http.get("/v1/jobs/nope-1").status_code == 401  # no key
    for job_id in ("nope-1", "nope-2"):
        response = http.get(f"/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 404
    samples = scrape(http)
    requests = "tokenfleet_gateway_requests_total"
    # One series for both ids: the route's template, never the raw path.
    assert value(samples, requests, route="/v1/jobs/{job_id}", method="GET", status="404",
                 tenant="acme") == 2
    assert value(samples, requests, route="/v1/jobs/{job_id}", status="401", tenant="") == 1
    assert not [s for s in samples if "nope" in str(s.labels)]
    assert value(samples, "tokenfleet_gateway_request_duration_seconds_count",
                 route="/v1/jobs/{job_id}") == 3
    # The pool's, the batch driver's and the webhooks' series are there from the start.
    assert value(samples, "tokenfleet_gateway_redis_connections_max") == (
        settings.gateway_redis_connections)
    assert value(samples, "tokenfleet_gateway_redis_connections_in_use") >= 0
    assert value(samples, "tokenfleet_gateway_redis_wait_timeouts_total") == 0
    assert value(samples, "tokenfleet_gateway_batch_lines_fed_total") == 0
    assert value(samples, "tokenfleet_gateway_webhook_deliveries_total", outcome="dead") == 0


def test_a_streamed_chat_request_is_read_in_the_request_and_ttft_histograms(
        gateway: Any, start_worker: Any) -> None:
    start_worker()
    http = gateway()
    body = {"model": "default", "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 12, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert len(chunks) > 2  # the role's opening chunk, then text
    route = "/v1/chat/completions"
    requests = "tokenfleet_gateway_requests_total"
    samples = scrape(http)
    ttft = value(samples, "tokenfleet_gateway_time_to_first_token_seconds_count", route=route)
    assert ttft == 1
    first = value(samples, "tokenfleet_gateway_time_to_first_token_seconds_sum", route=route)
    whole = value(samples, "tokenfleet_gateway_request_duration_seconds_sum", route=route)
    assert 0 < first <= whole
    assert value(samples, requests, route=route, method="POST", status="200", tenant="") == 1


def test_an_open_event_stream_is_counted_until_its_client_leaves(gateway: Any) -> None:
    http = gateway(require_worker=False)  # the job waits in a queue no worker reads
    job_id = http.post("/v1/jobs", json={"prompt": "waits", "model": "nobody-serves-this"}
                       ).json()["id"]
    route = "/v1/jobs/{job_id}/events"
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        assert response.status_code == 200
        assert value(scrape(http), "tokenfleet_gateway_open_streams", route=route) == 1
    wait_until(lambda: value(scrape(http), "tokenfleet_gateway_open_streams", route=route) == 0,
               timeout=30, what="the stream's end at the gateway")
    # No text went out: no time to first token.
    assert not [s for s in scrape(http)
                if s.name == "tokenfleet_gateway_time_to_first_token_seconds_count"
                and s.labels.get("route") == route]
