"""Two worker processes probed as a kubelet probes them, on their metrics port:
ready only once the model is loaded, live through a long step, not ready while
draining after SIGTERM (the job running still finishes)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import JobStatus

from helpers import free_port, wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # two Celery processes start
STEP_MS = 1200  # the gpu-sim worker's step: longer than a probe's period


def probe(port: int, path: str) -> tuple[int, dict[str, Any]] | None:
    """A probe's answer (status, body), or None where nothing listens yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (urllib.error.URLError, ConnectionError):
        return None


def answers_until_ready(port: int, worker: Any) -> list[tuple[int, dict[str, Any]]]:
    """Every ``/readyz`` answer from the process's start to its first 200."""
    seen: list[tuple[int, dict[str, Any]]] = []
    deadline = time.monotonic() + 120
    while not seen or seen[-1][0] != 200:
        assert worker.proc.poll() is None, worker.output()
        assert time.monotonic() < deadline, f"not ready in 120 s: {seen[-3:]}"
        answer = probe(port, "/readyz")
        if answer is not None:
            seen.append(answer)
        time.sleep(0.01)  # a probe's period, short: the loading is brief on the tiny model
    return seen


def test_two_workers_probed_as_a_kubelet_would(
    celery_workers: Any, client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    tiny_port, slow_port = free_port(), free_port()
    tiny = celery_workers("tiny@test", wait=False, TOKENFLEET_METRICS_PORT=str(tiny_port))
    slow = celery_workers("slow@test", wait=False,
                          TOKENFLEET_METRICS_PORT=str(slow_port), TOKENFLEET_ENGINE="gpu-sim",
                          TOKENFLEET_GPU_SIM_STEP_MS=str(STEP_MS), TOKENFLEET_QUEUE="slow",
                          TOKENFLEET_LIVENESS_S="60", TOKENFLEET_DRAIN_GRACE_S="60")

    # Ready only once the model is loaded: before, the port answers "loading".
    seen = answers_until_ready(tiny_port, tiny)
    assert {(s, b["why"]) for s, b in seen[:-1]} == {(503, "loading the model")}, seen
    assert seen[-1] == (200, {"ready": True, "why": "serving"})
    assert probe(tiny_port, "/healthz") is not None
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{tiny_port}/metrics", timeout=5).read()
    assert b"tokenfleet_tokens_generated_total" in metrics

    answers_until_ready(slow_port, slow)
    served = Keys(settings.namespace).queue_workers("slow")
    wait_until(lambda: r.zscore(served, "slow@test") is not None, timeout=30,
               what="the slow worker's first heartbeat")
    job = client.submit("a long step", model="slow", max_new_tokens=2)
    wait_until(lambda: client.status(job).status is JobStatus.RUNNING, timeout=30,
               what="the job to start")

    # Live while a step runs long: its engine thread has been away over a second.
    def in_a_long_step() -> bool:
        answer = probe(slow_port, "/healthz")
        assert answer is not None and answer[0] == 200, answer
        return bool(answer[1]["engine_away_s"] >= 1.0)

    wait_until(in_a_long_step, timeout=30, what="a step of over a second, live")

    # SIGTERM: Celery's warm shutdown drains. Not ready from then on, still live.
    slow.proc.terminate()

    def draining() -> bool:
        answer = probe(slow_port, "/readyz")
        assert answer is not None, "the port closed before the drain was seen"
        return answer[0] == 503 and bool(answer[1]["why"].startswith("draining"))

    wait_until(draining, timeout=30, what="/readyz to say draining")
    live = probe(slow_port, "/healthz")
    assert live is not None and live[0] == 200, live
    assert client.status(job).status is JobStatus.RUNNING  # it drains, it is not dropped
    assert slow.proc.wait(timeout=60) == 0, slow.output()
    state = client.wait(job, timeout=10)
    assert (state.status, len(state.token_ids)) == (JobStatus.SUCCEEDED, 2)
    assert probe(slow_port, "/readyz") is None  # the port closed with the process
    assert probe(tiny_port, "/readyz") == (200, {"ready": True, "why": "serving"})
