"""The gateway under hostile or failing conditions: clients that hang up mid-stream,
a Redis that goes away under live streams, clients that send a request a byte at
a time, and event streams that have nothing to say for a long while."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import redis

from tokenfleet import AsyncFleetClient, FleetClient
from tokenfleet.shared.wire.keys import Keys, job_id_in
from tokenfleet.shared.wire.schemas import JobStatus

from gateway_server import gateway, pin_live_worker, port_of  # noqa: F401  (a fixture)
from helpers import redis_client, stream_fault, url_id, wait_until, written_keys

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

WAITING = "waiting"  # a queue whose (pinned) live worker never reads: its jobs stay queued


def job_channels(r: redis.Redis, namespace: str) -> list[bytes]:
    """The job channels someone (the gateway) is subscribed to: events and ends."""
    keys = Keys(namespace)
    if hasattr(r, "ALL_NODES"):
        # On a cluster they are shard channels, each on its slot's node: every
        # node is asked.
        every = {"target_nodes": r.ALL_NODES}
        return [*r.pubsub_shardchannels(keys.events("*"), **every),
                *r.pubsub_shardchannels(keys.ends("*"), **every)]
    return [*r.pubsub_channels(keys.events("*")), *r.pubsub_channels(keys.ends("*"))]


async def stream_then_hang_up(http: httpx.AsyncClient, method: str, path: str,
                              body: dict[str, Any] | None, wait_for_data: bool,
                              opened: asyncio.Queue[None], now: asyncio.Event) -> None:
    """Open a stream (and read up to its first event if asked), then drop the
    connection with the body unread when ``now`` is set: a hang-up."""
    async with http.stream(method, path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        if wait_for_data:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break
        opened.put_nowait(None)
        await now.wait()


def test_clients_that_hang_up_mid_stream_leave_no_subscription_behind(
    gateway: Any, start_worker: Any, client: FleetClient, r: redis.Redis, settings: Any,
    report: dict[str, Any],
) -> None:
    start_worker()
    pin_live_worker(r, settings.namespace, WAITING)
    http = gateway()
    long = {"max_new_tokens": 1000, "temperature": 1.0}
    # As many running jobs as the worker's batch holds (16): each streams at once.
    running = [client.submit(f"A long story {i}", **long) for i in range(10)]
    queued = [client.submit("never runs", model=WAITING) for _ in range(40)]
    completion = {"prompt": "A long story", "max_tokens": 1000, "stream": True}
    subscribed_at_hang_up = 0

    async def clients() -> None:
        nonlocal subscribed_at_hang_up
        opened: asyncio.Queue[None] = asyncio.Queue()
        now = asyncio.Event()
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=60,
                                     limits=limits) as h:
            def go(method: str, path: str, body: dict[str, Any] | None,
                   data: bool) -> asyncio.Future[None]:
                return asyncio.ensure_future(
                    stream_then_hang_up(h, method, path, body, data, opened, now))

            streams = [*(go("GET", f"/v1/jobs/{url_id(j)}/events", None, True) for j in running),
                       *(go("GET", f"/v1/jobs/{url_id(j)}/events", None, False) for j in queued),
                       *(go("POST", "/v1/completions", completion, True) for _ in range(6)),
                       *(go("POST", "/v1/completions", {**completion, "model": WAITING}, False)
                         for _ in range(24))]
            for _ in streams:
                await asyncio.wait_for(opened.get(), timeout=60)
            # Every stream is live on the gateway's side, one job channel each: the
            # 64 of queued jobs for sure (a running job may have ended already).
            await asyncio.to_thread(
                wait_until, lambda: len(job_channels(r, settings.namespace)) >= 64, 30,
                "the gateway to subscribe to the streams' channels")
            subscribed_at_hang_up = len(job_channels(r, settings.namespace))
            now.set()
            await asyncio.gather(*streams)

    asyncio.run(clients())
    hung_up = time.monotonic()
    wait_until(lambda: not job_channels(r, settings.namespace), timeout=15,
               what="the gateway to unsubscribe from every job channel")
    seconds = time.monotonic() - hung_up
    for job_id in running:  # free the worker: an events client that leaves does not cancel
        client.cancel(job_id)

    # A completion stream that lost its client cancels its job; none is left to run.
    keys = Keys(settings.namespace)
    mine = set(running) | set(queued)
    completions = [job_id_in(k.decode(), keys.job("")) for k in r.scan_iter(match=keys.job("*"))]
    completions = [j for j in completions if j not in mine]
    assert len(completions) == 30
    wait_until(lambda: all(client.status(j).status.is_terminal for j in completions),
               timeout=30, what="every completion job to end")

    # The gateway still serves, streams included, and lets go of those too.
    job_id = http.post("/v1/jobs", json={"prompt": "still here",
                                         "sampling": {"max_new_tokens": 4}}).json()["id"]
    with http.stream("GET", f"/v1/jobs/{url_id(job_id)}/events") as response:
        assert response.status_code == 200
        assert any(line == "event: end" for line in response.iter_lines())
    assert http.get("/healthz").json() == {"ok": True}
    wait_until(lambda: not job_channels(r, settings.namespace), timeout=15,
               what="the last stream's channel to be released")
    report.update({"sse_clients": 50, "completion_clients": 30,
                   "subscribed_at_hang_up": subscribed_at_hang_up, "subscribed_after": 0,
                   "seconds_to_release": round(seconds, 2)})


OUTAGE_S = 4.0


async def test_streams_on_one_client_ride_out_a_redis_outage_side_by_side(
    aof_redis: Any, start_worker: Any, settings: Any, report: dict[str, Any],
) -> None:
    """Streams live across a Redis restart; some leave and some start while Redis
    is down. Leaving takes no time; none waits for another; all end complete."""
    on_aof = settings.model_copy(update={"redis_url": aof_redis.url})
    with FleetClient(settings=on_aof) as sync:
        jobs = [sync.submit(f"outage {i}", max_new_tokens=8, temperature=0,
                            require_worker=False) for i in range(6)]
    r = redis_client(aof_redis.url)
    done_at: dict[str, float] = {}

    async with AsyncFleetClient(settings=on_aof) as fleet:
        async def follow(job_id: str) -> list[Any]:
            events = [event async for event in fleet.stream(job_id)]
            done_at[job_id] = time.monotonic()
            return events

        before = {j: asyncio.ensure_future(follow(j)) for j in jobs[:4]}
        await asyncio.to_thread(wait_until, lambda: len(job_channels(r, on_aof.namespace)) == 4,
                                10, "the four streams to subscribe")
        aof_redis.stop()
        down_at = time.monotonic()
        during = {j: asyncio.ensure_future(follow(j)) for j in jobs[4:]}
        exits = []
        for job_id in jobs[:2]:  # two clients leave while Redis is down
            task = before.pop(job_id)
            await asyncio.sleep(0.5)
            left = time.monotonic()
            task.cancel()
            # Redis comes back only after this: a stream that waited for it to
            # leave would hang here until the test's timeout.
            with pytest.raises(asyncio.CancelledError):
                await task
            exits.append(time.monotonic() - left)
        await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
        await asyncio.to_thread(aof_redis.start)
        up_at = time.monotonic()
        await asyncio.to_thread(wait_until, lambda: len(job_channels(r, on_aof.namespace)) == 4,
                                15, "the four live streams to be subscribed again")
        resubscribed = time.monotonic() - up_at
        await asyncio.to_thread(start_worker, redis_url=aof_redis.url)
        streams = {**before, **during}
        results = dict(zip(streams, await asyncio.wait_for(asyncio.gather(*streams.values()),
                                                           timeout=60)))
        for job_id, events in results.items():
            state = await fleet.status(job_id)
            assert state.status is JobStatus.SUCCEEDED
            assert stream_fault(events, state) == ""
        await asyncio.to_thread(wait_until, lambda: not job_channels(r, on_aof.namespace), 15,
                                "the streams' channels to be released")
    r.close()
    report.update({"streams": 6, "outage_s": OUTAGE_S, "left_during_outage": 2,
                   "started_during_outage": 2, "slowest_exit_s": round(max(exits), 3),
                   "resubscribed_after_restart_s": round(resubscribed, 2),
                   "all_done_after_restart_s": round(max(done_at.values()) - up_at, 2)})


async def _trickle_head(port: int) -> tuple[float, bytes]:
    """Send a request head a byte every 0.2 s until the server closes (a server
    that never does hangs the test until its timeout); when, and what it said."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    answer = asyncio.ensure_future(reader.read())  # everything, up to the server's close
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: ")
    try:
        while not answer.done():
            writer.write(b"a")
            await asyncio.wait({answer}, timeout=0.2)
    except ConnectionError:
        pass
    await asyncio.wait({answer})
    closed = time.monotonic() - started
    writer.close()
    return closed, answer.result()


def test_a_request_head_sent_byte_by_byte_is_cut_off_at_the_header_timeout(
    gateway: Any, report: dict[str, Any]
) -> None:
    limit = 1.0
    http = gateway(header_timeout_s=limit)

    async def trickle() -> list[tuple[float, bytes]]:
        slow = [asyncio.ensure_future(_trickle_head(port_of(http))) for _ in range(100)]
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=10) as h:
            assert (await h.get("/healthz")).status_code == 200  # served meanwhile
        return await asyncio.gather(*slow)

    # Every trickling connection is closed (else this hangs), each with a 408:
    # the header timeout's answer, which nothing else in the gateway sends.
    results = asyncio.run(trickle())
    assert all(answer.startswith(b"HTTP/1.1 408") for _, answer in results)
    slowest = max(closed for closed, _ in results)
    report.update({"trickling_connections": 100, "header_timeout_s": limit,
                   "still_open": 0, "slowest_close_s": round(slowest, 2)})


async def _trickle_body(port: int, path: str, chunked: bool,
                        every_s: float = 0.2) -> tuple[float, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    # Longer than 10 s of bytes at any cadence here: the body never completes
    # before its deadline (200 did, at a byte every 2 ms: a 400, then a reset).
    length = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: 10000"
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: test\r\n"
                 b"Content-Type: application/json\r\n" + length + b"\r\n\r\n")
    answer = asyncio.ensure_future(reader.read())
    try:  # until the server answers and closes (one that never does hangs the test)
        while not answer.done():
            writer.write(b"1\r\na\r\n" if chunked else b"a")  # a byte at a time
            await asyncio.wait({answer}, timeout=every_s)
    except ConnectionError:
        pass
    await asyncio.wait({answer})
    writer.close()
    return time.monotonic() - started, answer.result()


def test_a_body_sent_byte_by_byte_is_408_at_the_body_timeout_and_nothing_is_enqueued(
    gateway: Any, r: redis.Redis, settings: Any, report: dict[str, Any]
) -> None:
    limit = 1.0
    http = gateway(body_timeout_s=limit)
    seconds = []
    for path, chunked in (("/v1/jobs", False), ("/v1/jobs", True),
                          ("/v1/completions", False), ("/v1/chat/completions", True)):
        took, answer = asyncio.run(_trickle_body(port_of(http), path, chunked))
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        # The 408 of the body timeout (it names its setting), and the connection closed.
        assert b"connection: close" in head.lower() and b"TOKENFLEET_BODY_TIMEOUT_S" in body
        seconds.append(took)
    assert http.get("/healthz").status_code == 200
    assert not written_keys(r, settings.namespace)
    report.update({"slow_bodies": len(seconds), "body_timeout_s": limit,
                   "answered_408_after_s": round(max(seconds), 2)})


def test_a_client_still_sending_when_its_408_goes_out_reads_the_408(
    gateway: Any, report: dict[str, Any]
) -> None:
    """A connection closed with bytes unread is reset, and the reset could
    overtake the 408: the gateway reads on until the client closes instead."""
    limit = 0.5
    http = gateway(body_timeout_s=limit)

    async def senders() -> list[tuple[float, bytes]]:
        return await asyncio.gather(*(_trickle_body(port_of(http), "/v1/jobs", False, every_s=0.002)
                                      for _ in range(20)))

    answers = [answer for _, answer in asyncio.run(senders())]
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in answers), answers
    report.update({"senders": len(answers), "every_s": 0.002, "read_408": len(answers)})


def keepalives(http: httpx.Client, method: str, path: str, body: dict[str, Any] | None,
               wanted: int) -> tuple[int, list[str]]:
    """Read a stream until ``wanted`` keep-alive comments came; what else came."""
    comments, other = 0, []
    with http.stream(method, path, json=body, timeout=httpx.Timeout(10, read=3)) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == ": keep-alive":
                comments += 1
                if comments == wanted:
                    break
            elif line:
                other.append(line)
    return comments, other


def test_event_streams_of_queued_jobs_send_keep_alives(
    gateway: Any, client: FleetClient, r: redis.Redis, settings: Any, report: dict[str, Any]
) -> None:
    pin_live_worker(r, settings.namespace, WAITING)
    interval = 0.2
    http = gateway(sse_keepalive_s=interval)
    job_id = client.submit("waits", model=WAITING)
    started = time.monotonic()
    streams = [("GET", f"/v1/jobs/{url_id(job_id)}/events", None),
               ("POST", "/v1/completions", {"model": WAITING, "prompt": "hi", "stream": True}),
               ("POST", "/v1/chat/completions", {"model": WAITING, "stream": True,
                                                 "messages": [{"role": "user", "content": "hi"}]})]
    for method, path, body in streams:
        comments, other = keepalives(http, method, path, body, wanted=3)
        assert comments == 3
        # Nothing but keep-alives before the job runs: not even chat's opening chunk
        # (the assistant's role), which goes with the first token, as vLLM's does.
        assert not other, other
    took = time.monotonic() - started
    assert client.status(job_id).status is JobStatus.QUEUED
    report.update({"streams": len(streams), "keepalive_s": interval,
                   "keepalives_each": 3, "seconds": round(took, 2)})
