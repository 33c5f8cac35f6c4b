"""Batches: OpenAI's ``/v1/batches`` and ``client.submit_batch`` on a real
redis-server, a real worker on the tiny model and a gateway (whose batch
driver runs them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tokenfleet import FleetClient
from tokenfleet.files import create_file
from tokenfleet.aio import AsyncFleetClient
from tokenfleet.shared.file_store import open_store
from tokenfleet.shared.settings import Settings

from gateway_server import gateway, port_of  # noqa: F401  (a fixture)
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["Once upon a time", "The function returns", "Hello there", "In the morning"]


@pytest.fixture
def batch_settings(settings: Settings, tmp_path: Path) -> Settings:
    return settings.model_copy(update={"files_url": f"file://{tmp_path}/files"})


@pytest.fixture
def fleet(batch_settings: Settings) -> Any:
    with FleetClient(settings=batch_settings) as c:
        yield c


def openai_client(http: httpx.Client, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(http)}/v1", api_key=key,
                         max_retries=0, timeout=60)


def completion_line(i: int, max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": f"c-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "default", "prompt": PROMPTS[i % len(PROMPTS)],
                     "max_tokens": max_tokens, "temperature": 0}}


def chat_line(i: int, max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": f"m-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "default", "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n"
                    for line in lines)


def upload(settings: Settings, data: bytes, tenant: str | None = None) -> str:
    """The input file, made as the files API makes it (``tokenfleet.files``)."""
    async def main() -> str:
        async with AsyncFleetClient(settings=settings) as c:
            file = await create_file(c.redis, c.keys, open_store(settings.files_url), [data],
                                     filename="in.jsonl", purpose="batch", tenant=tenant)
            return file.id
    import asyncio
    return asyncio.run(main())


def ended(oa: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    found: list[Any] = []

    def done() -> bool:
        found[:] = [oa.batches.retrieve(batch_id)]
        return found[0].status in ("completed", "failed", "expired", "cancelled")
    wait_until(done, timeout=timeout, what=f"batch {batch_id} to end")
    return found[0]


def results(oa: openai.OpenAI, file_id: str | None) -> dict[str, Any]:
    if file_id is None:
        return {}
    lines = [orjson.loads(line) for line in oa.files.content(file_id).content.splitlines()
             if line.strip()]
    return {line["custom_id"]: line for line in lines}


def test_submit_batch_runs_to_completed_with_one_output_line_per_request(
    gateway: Any, start_worker: Any, fleet: FleetClient, batch_settings: Settings
) -> None:
    start_worker()
    gateway(files_url=batch_settings.files_url)
    lines = [completion_line(i) for i in range(6)]
    batch = fleet.submit_batch(iter(lines), completion_window="24h")
    assert batch.status == "validating" and batch.endpoint == "/v1/completions"
    wait_until(lambda: fleet.batch(batch.id).status == "completed", timeout=60,
               what="the batch to complete")
    done = fleet.batch(batch.id)
    assert done.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}
    assert done.output_file_id and done.error_file_id is None
    out = list(fleet.batch_results(batch.id, order="input"))
    assert [line["custom_id"] for line in out] == [f"c-{i}" for i in range(6)]
    for i, line in enumerate(out):
        single = fleet.wait(fleet.submit(PROMPTS[i % len(PROMPTS)], max_new_tokens=4,
                                         temperature=0.0), timeout=60)
        body = line["response"]["body"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert body["object"] == "text_completion"
        assert body["choices"][0]["text"] == single.text
        job = fleet.status(line["response"]["request_id"])
        assert job.priority == "batch"
