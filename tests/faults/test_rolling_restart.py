"""A queue's only worker restarting (a rolling deploy, a Ctrl-C and a start):
for ``TOKENFLEET_NO_WORKER_GRACE_S`` after its last worker's liveness lapsed
or it left, the queue takes requests as if served, and they wait for the next
worker; past it, a request is a retryable 503; a name never served stays 404.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import httpx
import openai
import pytest
import redis

from tokenfleet import FleetClient, NoWorker, WorkersGone
from tokenfleet.shared.redis.clock import redis_now
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import JobStatus

from gateway_server import gateway, port_of  # noqa: F401  (a fixture)
from helpers import queue_parts, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(240)]

REQUESTS_PER_S = 4


def sim_worker(celery_workers: Any, node: str) -> Any:
    """A gpu-sim worker (no model to load: it starts as fast as a pod can)."""
    return celery_workers(node, TOKENFLEET_ENGINE="gpu-sim", TOKENFLEET_GPU_SIM_STEP_MS="10")


class SteadyLoad:
    """Completions through the gateway at a steady rate, each on a thread of
    its own (as many clients would send them), with the official client, no
    retries: what each got back."""

    def __init__(self, http: httpx.Client) -> None:
        self.oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(http)}/v1",
                                api_key="unused", max_retries=0, timeout=120)
        self.outcomes: list[str] = []
        self._sent: list[threading.Thread] = []
        self._stop = threading.Event()
        self._pacer = threading.Thread(target=self._pace, daemon=True)

    def __enter__(self) -> SteadyLoad:
        self._pacer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._pacer.join()
        for sender in self._sent:
            sender.join(150)

    def _pace(self) -> None:
        while not self._stop.wait(1 / REQUESTS_PER_S):
            sender = threading.Thread(target=self._one, daemon=True)
            sender.start()
            self._sent.append(sender)

    def _one(self) -> None:
        try:
            done = self.oa.completions.create(model="default", prompt="tell me", max_tokens=8)
            self.outcomes.append("ok" if done.choices[0].text else "empty")
        except openai.APIStatusError as exc:
            self.outcomes.append(f"{exc.status_code} {exc.code}")
        except openai.APIError as exc:
            self.outcomes.append(type(exc).__name__)

    def wait_for(self, ok: int) -> None:
        wait_until(lambda: self.outcomes.count("ok") >= ok, timeout=60,
                   what=f"{ok} requests answered")


def test_a_rolling_restart_of_a_queues_only_worker_loses_no_request_and_gives_no_404(
    gateway: Any, celery_workers: Any, r: redis.Redis, settings: Any,
    report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    old = sim_worker(celery_workers, "cpu@pod-1")
    http = gateway()
    with SteadyLoad(http) as load:
        load.wait_for(4)
        # The rolling deploy: the old pod stops (a warm shutdown takes it out
        # of the served set at once), then its replacement, named anew, starts.
        assert old.stop(timeout=60) == 0
        gone_at = time.monotonic()
        assert not any(r.zcard(keys.queue_workers(p)) for p in queue_parts(r, keys))
        sent_before = len(load.outcomes)
        sim_worker(celery_workers, "cpu@pod-2")
        without_worker_s = time.monotonic() - gone_at
        load.wait_for(sent_before + 4)
    outcomes = Counter(load.outcomes)
    assert outcomes == {"ok": len(load.outcomes)}, outcomes
    report.update(requests=len(load.outcomes), without_a_worker_s=round(without_worker_s, 1))


def served_ago(r: redis.Redis, keys: Keys, queue: str, seconds: float) -> None:
    """As if the queue's last worker's liveness had lapsed ``seconds`` ago."""
    r.set(keys.served_until(queue), repr(redis_now(r) - seconds))


def test_a_queue_served_within_the_grace_queues_and_past_it_is_a_retryable_503(
    gateway: Any, client: FleetClient, r: redis.Redis, settings: Any,
) -> None:
    keys = Keys(settings.namespace)
    assert settings.no_worker_grace_s == 60.0
    for part in queue_parts(r, keys, "restarting"):
        served_ago(r, keys, part, 20)
    job_id = client.submit("waits for the restart", model="restarting", max_new_tokens=2)
    assert client.status(job_id).status is JobStatus.QUEUED

    for part in queue_parts(r, keys, "gone"):
        served_ago(r, keys, part, 90)
    with pytest.raises(WorkersGone, match=r"queue 'gone' for 90 s, past the grace period of 60 s"):
        client.submit("nobody back", model="gone")
    http = gateway()
    body = {"model": "gone", "prompt": "nobody back", "max_tokens": 2}
    refused = http.post("/v1/completions", json=body)
    assert refused.status_code == 503, refused.text
    assert refused.headers["x-should-retry"] == "true" and int(refused.headers["Retry-After"]) > 0
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("model_unavailable", "model")
    assert "'gone'" in error["message"] and "retry later" in error["message"]

    # A name no worker ever served: 404, not worth a retry.
    with pytest.raises(NoWorker) as unknown:
        client.submit("typo", model="restartnig")
    assert not isinstance(unknown.value, WorkersGone)
    missing = http.post("/v1/completions", json={**body, "model": "restartnig"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert missing.headers["x-should-retry"] == "false"
