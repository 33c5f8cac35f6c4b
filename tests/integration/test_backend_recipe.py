"""A web backend's view of the client: the job's end at the end of its stream,
refusals as one JSON-ready error, and a job that ends when its consumer goes away
(the FastAPI example of docs/api.md, run as it is)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import redis

from tokenfleet import (AsyncFleetClient, EndEvent, FleetClient, InvalidRequest, JobStatus,
                        TokenfleetError)
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import StepBatch

from helpers import wait_until

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


class SlowRunner(HFRunner):
    """The real model at a token every 20 ms: a 1,000-token job runs 20 s unless
    it is cancelled."""

    def run(self, batch: StepBatch) -> list[int]:
        time.sleep(0.02)  # a big model's step time, not a synchronisation
        return super().run(batch)


def test_stream_with_final_ends_with_the_jobs_end_event(
    client: FleetClient, start_worker: Callable[..., Any]
) -> None:
    start_worker()
    job_id = client.submit("Once upon a time", max_new_tokens=12, temperature=0.0)
    *events, end = list(client.stream(job_id, timeout=60, final=True))
    assert isinstance(end, EndEvent)
    assert (end.status, end.finish_reason) == (JobStatus.SUCCEEDED, "length")
    assert "".join(e.text for e in events if not isinstance(e, EndEvent)) == \
        client.status(job_id).text
    # Without final, the stream is the token events alone, as before.
    assert not any(isinstance(e, EndEvent) for e in client.stream(job_id, timeout=60))


async def test_async_stream_with_final_ends_with_the_end_event_of_a_cancelled_job(
    settings: Any, start_worker: Callable[..., Any], loaded_tiny: Any
) -> None:
    start_worker(runner=SlowRunner(*loaded_tiny))
    async with AsyncFleetClient(settings=settings) as c:
        job_id = await c.submit("Once upon a time", max_new_tokens=1000)
        seen: list[Any] = []
        async for event in c.stream(job_id, timeout=60, final=True):
            seen.append(event)
            if len(seen) == 1:
                assert await c.cancel(job_id, timeout=0) is False  # asked, not yet ended
    assert isinstance(seen[-1], EndEvent) and seen[-1].status is JobStatus.CANCELLED


def test_an_invalid_request_is_a_tokenfleet_error_with_json_ready_details(
    client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    with pytest.raises(InvalidRequest, match="max_new_tokens") as info:
        client.submit("hello", max_new_tokens=0, temperature="hot", require_worker=False)
    assert isinstance(info.value, TokenfleetError) and isinstance(info.value, ValueError)
    details = json.loads(json.dumps(info.value.errors))  # serialisable as it is
    assert {tuple(e["loc"]) for e in details} == {("sampling", "max_new_tokens"),
                                                  ("sampling", "temperature")}
    assert all(set(e) == {"loc", "msg", "type"} for e in details)  # no input echoed
    assert r.keys(f"{settings.namespace}:*") == []


async def test_a_generation_cancels_its_job_when_its_task_is_cancelled(
    settings: Any, start_worker: Callable[..., Any], loaded_tiny: Any
) -> None:
    # As Starlette does when an HTTP client leaves: the streaming task's scope is
    # cancelled, and anyio cancels every await in it again, a cleanup's included.
    start_worker(runner=SlowRunner(*loaded_tiny))
    async with AsyncFleetClient(settings=settings) as c:
        streaming = anyio.Event()
        job_id = ""
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:
                async def consume() -> None:
                    nonlocal job_id
                    async with c.generation("Once upon a time", max_new_tokens=1000) as gen:
                        job_id = gen.job_id
                        async for _event in gen:
                            streaming.set()
                tasks.start_soon(consume)
                await streaming.wait()
                scope.cancel()
        state = await c.wait(job_id, timeout=30)
        assert state.status is JobStatus.CANCELLED
        assert 0 < len(state.token_ids) < 1000


def test_a_generation_left_early_cancels_and_one_run_to_its_end_does_not(
    client: FleetClient, start_worker: Callable[..., Any], loaded_tiny: Any
) -> None:
    start_worker()
    with client.generation("Once upon a time", max_new_tokens=8, temperature=0.0) as whole:
        texts = [event.text for event in whole]
    assert whole.end is not None and whole.end.status is JobStatus.SUCCEEDED
    assert "".join(texts) == whole.text == client.status(whole.job_id).text

    start_worker("w2@test", runner=SlowRunner(*loaded_tiny))
    with client.generation("Once upon a time", max_new_tokens=1000) as left:
        for _event in left:
            break
    assert client.wait(left.job_id, timeout=30).status is JobStatus.CANCELLED


# The FastAPI example of docs/api.md, as a user would copy it.

def recipe_source() -> str:
    page = (ROOT / "docs" / "api.md").read_text()
    section = page.split("## In a web backend", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/api.md lost its FastAPI example"
    return match.group(1)


@pytest.fixture
def recipe(tmp_path: Path, settings: Any) -> Iterator[httpx.Client]:
    (tmp_path / "backend.py").write_text(recipe_source())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "TOKENFLEET_REDIS_URL": settings.redis_url,
           "TOKENFLEET_NAMESPACE": settings.namespace}
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "backend:app", "--port",
                               str(port), "--log-level", "warning"], cwd=tmp_path, env=env)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

    def listening() -> bool:
        assert server.poll() is None, "the example backend exited"
        try:
            return http.post("/stories", json={}).status_code == 422
        except httpx.TransportError:
            return False
    wait_until(listening, timeout=30, what="the example backend to listen")
    yield http
    http.close()
    server.terminate()
    server.wait(timeout=20)


@pytest.mark.slow
def test_the_docs_fastapi_example_streams_refuses_and_cancels_a_job_whose_client_left(
    recipe: httpx.Client, start_worker: Callable[..., Any], r: redis.Redis, settings: Any,
    loaded_tiny: Any
) -> None:
    refused = recipe.post("/stories", json={"prompt": "Hi", "max_new_tokens": 0})
    assert refused.status_code == 400
    assert refused.json()["detail"]["errors"][0]["loc"] == ["sampling", "max_new_tokens"]

    start_worker()
    whole = recipe.post("/stories", json={"prompt": "Once upon a time", "max_new_tokens": 8})
    assert whole.status_code == 200
    end = json.loads(whole.text.rstrip("\n").rsplit("\n", 1)[1])
    assert end == {"status": "succeeded", "finish_reason": "length", "error": None}

    start_worker("w2@test", runner=SlowRunner(*loaded_tiny))
    with recipe.stream("POST", "/stories",
                       json={"prompt": "Once upon a time", "max_new_tokens": 1000}) as response:
        job_id = response.headers["X-Job-Id"]
        next(response.iter_raw())  # the story has begun; then the client goes away
    keys = Keys(settings.namespace)
    wait_until(lambda: r.hget(keys.job(job_id), "status") == b"cancelled", timeout=30,
               what="the job of the client that left to end cancelled")
