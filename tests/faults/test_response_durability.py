"""A background response (``POST /v1/responses`` with ``background: true``)
survives what kills the processes around it: kill -9 of the worker running it
(another resumes it, and no delta repeats), kill -9 of the gateway that made it
(another gateway serves its object and its stream, resumed at any sequence
number), and a stop of the whole fleet, Redis included (with its append-only
file), for 10 s.

Gateways are processes here (``tokenfleet gateway``), so that a kill -9 is one;
workers are Celery workers on the gpu-sim engine (a step of 50 ms, the tiny
model's tokenizer and chat template, no weights), so a response runs long
enough to be killed mid-way, one token per event (``TOKENFLEET_COALESCE_MS=0``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tokenfleet.shared.wire.keys import Keys

from gateway_server import sse_events
from helpers import redis_client, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 200  # the response's length: 200 deltas and the events around them


class GatewayProcess:
    """``tokenfleet gateway`` as a child process, on a free port."""

    def __init__(self, env: dict[str, str]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile(prefix="gateway-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tokenfleet.cli.app import main; main()", "gateway",
             "--port", str(self.port)], env=env, cwd=ROOT, stdout=self.log,
            stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}/v1", timeout=60)
        wait_until(self._up, timeout=60, what="the gateway to serve")

    def _up(self) -> bool:
        assert self.proc.poll() is None, Path(self.log.name).read_text(errors="replace")
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).is_success
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.kill()
        self.log.close()


@pytest.fixture
def fleet_env(settings: Any) -> Callable[[str], dict[str, str]]:
    def env(redis_url: str) -> dict[str, str]:
        return {**os.environ, "TOKENFLEET_REDIS_URL": redis_url,
                "TOKENFLEET_NAMESPACE": settings.namespace, "TOKENFLEET_QUEUE": "default",
                "TOKENFLEET_GATEWAY_AUTH": "off", "PYTHONUNBUFFERED": "1"}
    return env


@pytest.fixture
def gateway_procs() -> Iterator[Callable[[dict[str, str]], GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(env: dict[str, str]) -> GatewayProcess:
        started.append(GatewayProcess(env))
        return started[-1]

    yield start
    for gateway in started:
        gateway.close()


def sim_worker(celery_workers: Any, node: str, **env: str) -> Any:
    return celery_workers(node, TOKENFLEET_ENGINE="gpu-sim", TOKENFLEET_GPU_SIM_STEP_MS="50",
                          TOKENFLEET_HEARTBEAT_S="1", TOKENFLEET_BLOCK_MS="100",
                          TOKENFLEET_COALESCE_MS="0", **env)


def background(http: httpx.Client) -> str:
    made = http.post("/responses", json={"model": "default", "input": "Tell a long story.",
                                         "background": True, "max_output_tokens": TOKENS,
                                         "ignore_eos": True})
    assert made.status_code == 200, made.text
    assert made.json()["status"] == "queued"
    return str(made.json()["id"])


def stream(http: httpx.Client, rid: str, after: int = -1,
           into: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The response's events after ``after``, as they come (into ``into``)."""
    out = [] if into is None else into
    with http.stream("GET", f"/responses/{rid}",
                     params={"stream": "true", "starting_after": after}) as got:
        assert got.status_code == 200
        for event in sse_events(got.iter_lines()):
            out.append(json.loads(event["data"]))
    return out


def follow(http: httpx.Client, rid: str) -> tuple[list[dict[str, Any]], threading.Thread]:
    """Reads the stream in a thread until it ends or its gateway dies."""
    events: list[dict[str, Any]] = []

    def read() -> None:
        try:
            stream(http, rid, into=events)
        except httpx.HTTPError:
            pass  # its gateway was killed

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return events, thread


def deltas(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "response.output_text.delta"]


def whole(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in deltas(events))


def test_a_background_response_survives_a_kill_of_its_worker(
        settings: Any, celery_workers: Any, gateway_procs: Any, fleet_env: Any, r: redis.Redis,
        report: dict[str, Any]) -> None:
    keys = Keys(settings.namespace)
    workers = {node: sim_worker(celery_workers, node) for node in ("sim@one", "sim@two")}
    gateway = gateway_procs(fleet_env(settings.redis_url))
    rid = background(gateway.http)
    events, reader = follow(gateway.http, rid)
    wait_until(lambda: len(deltas(events)) >= 5, timeout=60, what="the response's first deltas")
    job_id = json.loads(r.get(keys.response(rid)))["job_id"]
    holder = r.hget(keys.job(job_id), "worker").decode()
    workers[holder].kill()
    reader.join(120)
    assert not reader.is_alive(), "the stream did not end"
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"  # max_output_tokens reached
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert whole(events) == final["output"][0]["content"][0]["text"]
    assert final["usage"]["output_tokens"] == TOKENS
    assert int(r.hget(keys.job(job_id), "attempts")) == 2
    # The stream read live, across the kill, is the one any later reader replays.
    assert stream(gateway.http, rid) == events
    assert gateway.http.get(f"/responses/{rid}").json() == final
    report.update(events=len(events), deltas=len(deltas(events)), duplicated=0, missing=0)


def test_a_background_response_survives_a_kill_of_its_gateway_and_resumes_at_any_event(
        settings: Any, celery_workers: Any, gateway_procs: Any, fleet_env: Any,
        report: dict[str, Any]) -> None:
    sim_worker(celery_workers, "sim@one")
    env = fleet_env(settings.redis_url)
    first, second = gateway_procs(env), gateway_procs(env)
    rid = background(first.http)
    events, reader = follow(first.http, rid)
    wait_until(lambda: len(deltas(events)) >= 5, timeout=60, what="the response's first deltas")
    first.kill()
    reader.join(30)
    seen = events[-1]["sequence_number"]
    # The other gateway serves the rest of the stream, from the last event seen.
    rest = stream(second.http, rid, after=seen)
    uninterrupted = stream(second.http, rid)
    assert events + rest == uninterrupted
    assert len(uninterrupted) >= TOKENS
    assert uninterrupted[-1]["type"] == "response.incomplete"
    # And from every sequence number: the same events as one uninterrupted stream.
    duplicated = missing = 0
    for after in range(-1, len(uninterrupted)):
        resumed = stream(second.http, rid, after=after)
        expected = uninterrupted[after + 1:]
        got = [e["sequence_number"] for e in resumed]
        duplicated += len(got) - len(set(got))
        missing += len({e["sequence_number"] for e in expected} - set(got))
        assert resumed == expected, after
    assert second.http.get(f"/responses/{rid}").json() == uninterrupted[-1]["response"]
    report.update(events=len(uninterrupted), resumes=len(uninterrupted) + 1,
                  duplicated=duplicated, missing=missing)


def test_a_background_response_completes_after_the_whole_fleet_stopped_for_10_s(
        aof_redis: Any, settings: Any, celery_workers: Any, gateway_procs: Any, fleet_env: Any,
        report: dict[str, Any]) -> None:
    env = fleet_env(aof_redis.url)
    r = redis_client(aof_redis.url)
    keys = Keys(settings.namespace)
    worker = sim_worker(celery_workers, "sim@before", TOKENFLEET_REDIS_URL=aof_redis.url,
                        wait=False)
    wait_until(lambda: r.exists(keys.worker("sim@before")) or worker.proc.poll() is not None,
               timeout=180, what="the worker's first heartbeat")
    gateway = gateway_procs(env)
    rid = background(gateway.http)
    job_id = json.loads(r.get(keys.response(rid)))["job_id"]
    wait_until(lambda: r.xlen(keys.out(job_id)) >= 5, timeout=120,
               what="the response's first tokens")
    # The whole fleet stops: the worker and the gateway die, Redis writes its
    # append-only file and exits.
    worker.kill()
    gateway.kill()
    aof_redis.stop()
    r.close()
    stopped_at = time.monotonic()
    time.sleep(10.0)  # the outage the test is about, not a wait for an event
    aof_redis.start()
    sim_worker(celery_workers, "sim@after", TOKENFLEET_REDIS_URL=aof_redis.url, wait=False)
    gateway = gateway_procs(env)
    events = stream(gateway.http, rid)
    done_s = time.monotonic() - stopped_at
    assert events[-1]["type"] == "response.incomplete"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = gateway.http.get(f"/responses/{rid}").json()
    assert final == events[-1]["response"]
    assert final["usage"]["output_tokens"] == TOKENS
    assert whole(events) == final["output"][0]["content"][0]["text"]
    report.update(outage_s=10.0, completed_after_s=round(done_s, 1), events=len(events))
