"""A worker's probes, as a kubelet reads them: live while its engine thread
comes back within TOKENFLEET_LIVENESS_S (a long step included), ready only
while it serves; and the HTTP server of its metrics port, which stops with it."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import pytest

from tokenfleet.workers.health import Health, Phase, StatusServer
from tokenfleet.workers.metrics import Metrics
from tokenfleet.workers.stats import WorkerStats

from helpers import free_port


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_step_within_the_bound_is_live_and_one_past_it_is_not() -> None:
    clock = Clock()
    health = Health(liveness_s=60, clock=clock)
    assert health.live()[0]  # loading: no engine thread to judge yet
    health.set(Phase.SERVING)
    health.turn()  # the engine thread starts a step
    clock.now += 59  # a long step: still live
    live, body = health.live()
    assert live and body["engine_away_s"] == 59
    clock.now += 2  # past the bound: hung
    live, body = health.live()
    assert not live and "TOKENFLEET_LIVENESS_S" in body["why"]
    health.turn()  # it came back
    assert health.live()[0]


def test_ready_only_while_serving_with_the_intake_open() -> None:
    health = Health(liveness_s=60)
    assert health.ready() == (False, {"ready": False, "why": "loading the model"})
    health.set(Phase.SERVING)
    assert health.ready()[0]
    paused = threading.Event()
    health.intake_paused = paused.is_set
    paused.set()
    assert health.ready() == (False, {"ready": False, "why": "paused: reading no new job"})
    paused.clear()
    health.set(Phase.DRAINING)
    ready, body = health.ready()
    assert not ready and body["why"].startswith("draining")
    assert health.live()[0]  # draining is no reason to restart it


def test_a_worker_that_gave_up_is_neither_live_nor_ready_even_as_it_drains() -> None:
    health = Health(liveness_s=60)
    health.set(Phase.FAILED, "CUDA error: device lost")
    health.set(Phase.DRAINING)  # its stop follows: the failure stays
    for ok, body in (health.live(), health.ready()):
        assert not ok and "device lost" in body["why"]


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_status_server_answers_probes_and_metrics_then_frees_its_port() -> None:
    health, port = Health(liveness_s=60), free_port()
    server = StatusServer(health)
    before = set(threading.enumerate())
    server.serve(port)
    status, body = get(port, "/readyz")
    assert status == 503 and json.loads(body) == {"ready": False, "why": "loading the model"}
    assert get(port, "/healthz")[0] == 200
    assert b"tokenfleet_tokens_generated" not in get(port, "/metrics")[1]  # not built yet
    server.show(Metrics("q", WorkerStats()).registry)
    health.set(Phase.SERVING)
    assert get(port, "/readyz") == (200, b'{"ready":true,"why":"serving"}')
    assert b"tokenfleet_tokens_generated_total" in get(port, "/metrics")[1]

    server.close()
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    with socket.socket() as s:  # nothing listens there any more
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
    server.close()  # a second close does nothing
