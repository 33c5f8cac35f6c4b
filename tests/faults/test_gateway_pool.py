"""The gateway's Redis connections under a spike: far more concurrent requests
than connections it may hold. Each is answered (accepted, or a 503 that says the
fleet is busy), none says Redis cannot be reached, the connections never pass
the bound, and seconds after the spike only the idle pool is left open.

A redis-server of the test's own: its ``CLIENT LIST`` holds the gateway's
connections and the counter's one, nothing else."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis

from tokenfleet.shared.wire.keys import Keys

from gateway_server import gateway, pin_live_worker, port_of  # noqa: F401  (a fixture)
from helpers import RedisServer, url_id, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300),
              pytest.mark.single_redis("counts the connections of one redis-server")]

WAITING = "waiting"  # a queue whose (pinned) live worker never reads: its jobs stay queued
CONNECTIONS = 16  # the gateway's bound in these tests
SPIKE = 2500  # concurrent requests: far more than the bound (the default bound is 100)
# A connection closes once idle for 5 s, looked for each second (shared/redis/pool.py);
# the rest is slack for a loaded machine: the test is that they close, not how fast.
BACK_TO_IDLE_S = 20.0


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.close()


# The test's own connections carry this name: the counter is used from the
# sampling thread and the test's at once, so it may hold two, not one.
COUNTER = "pool-test-counter"


def counter_for(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, client_name=COUNTER)


def gateway_clients(counter: redis.Redis) -> list[dict[str, Any]]:
    """``CLIENT LIST``'s entries for the gateway's connections (the counter's own left out)."""
    return [client for client in counter.client_list() if client.get("name") != COUNTER]


def gateway_connections(counter: redis.Redis) -> int:
    """The connections open on the test's own Redis, the counter's own left out."""
    return len(gateway_clients(counter))


def wait_back_to_idle(counter: redis.Redis, at_most: int, what: str) -> None:
    """Until at most ``at_most`` gateway connections are open; a failure shows each
    one left open (its age, idle seconds and last command), so that a connection the
    pool lost tells itself apart from a slow sweep."""
    try:
        wait_until(lambda: gateway_connections(counter) <= at_most, BACK_TO_IDLE_S, what)
    except TimeoutError as exc:
        left = [{key: client.get(key) for key in ("age", "idle", "cmd", "flags", "sub")}
                for client in gateway_clients(counter)]
        raise AssertionError(f"{exc}: {len(left)} open, at most {at_most} expected: {left}") from None


class PeakCounter:
    """Samples the gateway's connection count while a spike runs, in a thread."""

    def __init__(self, counter: redis.Redis) -> None:
        self._counter = counter
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._open_across_two_looks())

    def _open_across_two_looks(self) -> int:
        """The connections open at one look and still open at the next, a moment
        later. A connection the gateway just closed can still be listed beside the
        one that takes its slot (Redis reads the close and the new connect in one
        pass, in either order): one over the bound in a single look, never in two.
        Every connection in both looks was open at the first, so this never counts
        more than the gateway held."""
        first = {client["id"] for client in gateway_clients(self._counter)}
        return len(first & {client["id"] for client in gateway_clients(self._counter)})


async def http_request(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes, bytes]:
    """One request on a connection of its own, read to the server's close: the
    status, the head and the body. Raw, so that thousands at once cost the test
    little next to the gateway they load."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        answer = await reader.read()
    finally:
        writer.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, rest


def busy(status: int, head: bytes, body: bytes) -> bool:
    """A 503 that says the fleet is busy and when to retry."""
    return (status == 503 and b"busy" in body and b"cannot be reached" not in body
            and b"retry-after: " in head.lower())


def test_a_spike_of_requests_waits_for_the_bounded_pool_and_leaves_only_the_idle_pool(
    gateway: Any, own_redis: RedisServer, settings: Any, report: dict[str, Any]
) -> None:
    counter = counter_for(own_redis.url)
    pin_live_worker(counter, settings.namespace, WAITING)
    http = gateway(redis_url=own_redis.url, gateway_redis_connections=CONNECTIONS)
    known = http.post("/v1/jobs", json={"prompt": "read me", "model": WAITING}).json()["id"]
    submit = orjson.dumps({"prompt": "spike", "model": WAITING})

    async def spike() -> list[tuple[int, bytes, bytes]]:
        # Every second request a submit, the others a read of a job: two routes, one pool.
        return await asyncio.gather(*(
            http_request(port_of(http), "POST", "/v1/jobs", submit) if i % 2 == 0
            else http_request(port_of(http), "GET", f"/v1/jobs/{url_id(known)}")
            for i in range(SPIKE)))

    started = time.monotonic()
    with PeakCounter(counter) as peak:
        answers = asyncio.run(spike())
    took = time.monotonic() - started
    ended = time.monotonic()

    accepted = sum(status == 202 for status, _, _ in answers)
    read = sum(status == 200 for status, _, _ in answers)
    refused = [(status, body) for status, head, body in answers
               if status not in (200, 202) and not busy(status, head, body)]
    assert not refused, refused[:5]
    # Every accepted submit is queued, and only those.
    keys = Keys(settings.namespace)
    assert len(list(counter.scan_iter(match=keys.job("*"), count=1000))) == accepted + 1
    assert peak.peak <= CONNECTIONS, f"{peak.peak} connections open at once, bound {CONNECTIONS}"

    # Nothing streams here: the idle pool is empty.
    wait_back_to_idle(counter, 0, "the gateway's connections to close once idle")
    idle_after = time.monotonic() - ended
    assert http.get("/healthz").json() == {"ok": True}  # and it serves on
    counter.close()
    report.update({"requests": SPIKE, "bound": CONNECTIONS, "accepted": accepted, "read": read,
                   "busy_503": SPIKE - accepted - read, "unreachable": 0,
                   "peak_connections": peak.peak, "spike_s": round(took, 1),
                   "back_to_idle_s": round(idle_after, 1)})


STREAMS = 200  # event streams opened at once, each reading its job's record first


async def open_stream(port: int, job_id: str) -> tuple[int, bytes, asyncio.StreamWriter]:
    """An event stream, open: its status and head, and the writer that hangs it up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /v1/jobs/{url_id(job_id)}/events HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status != 200:  # a refusal: its body is short, and the gateway closes after it
        head += await reader.read(4096)
    return status, head, writer


def test_a_spike_of_event_streams_shares_the_bounded_pool_and_leaves_only_its_subscriber(
    gateway: Any, own_redis: RedisServer, settings: Any, report: dict[str, Any]
) -> None:
    from tokenfleet import FleetClient

    counter = counter_for(own_redis.url)
    pin_live_worker(counter, settings.namespace, WAITING)
    on_own = settings.model_copy(update={"redis_url": own_redis.url})
    with FleetClient(settings=on_own) as client:  # closed before the count starts
        jobs = [client.submit(f"queued {i}", model=WAITING) for i in range(STREAMS)]
    http = gateway(redis_url=own_redis.url, gateway_redis_connections=CONNECTIONS // 2)
    # Closed before the spike: closed during it, Redis could still list it
    # beside the connection that takes its slot, one over the bound in the count.
    wait_until(lambda: gateway_connections(counter) == 0, BACK_TO_IDLE_S,
               "the startup connection to close once idle")

    async def streams() -> tuple[list[tuple[int, bytes]], int]:
        opened = await asyncio.gather(*(open_stream(port_of(http), j) for j in jobs))
        live = sum(status == 200 for status, _, _ in opened)
        # Every stream that opened is subscribed to its job's channel: only then
        # has it read the job's record and log, the reads of the spike.
        await asyncio.to_thread(
            wait_until, lambda: len(counter.pubsub_channels(f"{settings.namespace}:*")) >= live,
            60, "the open streams to subscribe")
        for _, _, writer in opened:  # every client hangs up
            writer.close()
        return [(status, head) for status, head, _ in opened], live

    with PeakCounter(counter) as peak:
        answers, live = asyncio.run(streams())
    hung_up = time.monotonic()

    refused = [head for status, head in answers
               if status != 200 and not busy(status, head, head)]
    assert not refused, refused[:5]
    assert peak.peak <= CONNECTIONS // 2, f"{peak.peak} connections at once, bound {CONNECTIONS // 2}"
    # Left open: the one subscriber connection the gateway keeps for its streams.
    wait_back_to_idle(counter, 1, "the gateway's connections to close once its streams are gone")
    idle_after = time.monotonic() - hung_up
    counter.close()
    report.update({"streams": STREAMS, "bound": CONNECTIONS // 2, "opened": live,
                   "busy_503": STREAMS - live, "unreachable": 0, "peak_connections": peak.peak,
                   "back_to_idle_s": round(idle_after, 1)})


def test_a_request_that_finds_no_connection_free_in_time_is_a_503_busy_with_retry_after(
    gateway: Any, own_redis: RedisServer, settings: Any
) -> None:
    counter = counter_for(own_redis.url)
    pin_live_worker(counter, settings.namespace, WAITING)
    http = gateway(redis_url=own_redis.url, gateway_redis_connections=2, gateway_redis_wait_s=0.5)
    job = orjson.dumps({"prompt": "held", "model": WAITING})
    completion = orjson.dumps({"prompt": "held", "model": WAITING, "max_tokens": 4})
    sent = [("/v1/jobs", job), ("/v1/completions", completion)] * 3

    async def requests() -> tuple[list[tuple[str, int, bytes, bytes]], tuple[int, bytes, bytes]]:
        tasks = {asyncio.ensure_future(http_request(port_of(http), "POST", path, body)): path
                 for path, body in sent}
        answers = []
        # Submits write, so while writes are paused the first two hold both
        # connections; the other four find none free, and are answered first.
        for done in asyncio.as_completed(tasks):
            answers.append(await done)
            if len(answers) == 4:
                break
        # Both connections still held: the gateway says it is not ready.
        ready = await http_request(port_of(http), "GET", "/readyz")
        for task in tasks:  # the two held ones are let go: their clients hang up
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        by_answer = {id(t.result()): path for t, path in tasks.items()
                     if not t.cancelled() and t.exception() is None}
        return [(by_answer.get(id(a), "?"), *a) for a in answers], ready

    counter.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        answers, ready = asyncio.run(requests())
    finally:
        counter.execute_command("CLIENT", "UNPAUSE")
    paths = set()
    for path, status, head, body in answers:
        assert busy(status, head, body), (status, head, body)
        message = orjson.loads(body)
        # Each route's own error shape: FastAPI's for the jobs API, OpenAI's for completions.
        if "error" in message:
            assert message["error"]["code"] == "busy" and message["error"]["type"] == "server_error"
            assert "TOKENFLEET_GATEWAY_REDIS_CONNECTIONS" in message["error"]["message"]
        else:
            assert "TOKENFLEET_GATEWAY_REDIS_CONNECTIONS" in message["detail"]
        paths.add(path)
    assert paths == {"/v1/jobs", "/v1/completions"}  # at most two of six held: both kinds refused
    assert ready[0] == 503, ready
    assert "TOKENFLEET_GATEWAY_REDIS_CONNECTIONS" in orjson.loads(ready[2])["why"]
    assert http.get("/healthz").json() == {"ok": True}
    assert http.get("/readyz").json() == {"ok": True}  # connections free again
    counter.close()
