"""A worker started with only ``--model tiny`` is what an OpenAI client asks
for as ``model="tiny"``: no queue named anywhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from gateway_server import gateway  # noqa: F401
from helpers import wait_until

from tokenfleet.shared.wire.keys import Keys

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_of_model_tiny_serves_model_tiny_to_an_openai_client(
        settings: Any, r: redis.Redis, gateway: Any, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENFLEET_QUEUE", "TOKENFLEET_MODEL")}
    env.update(TOKENFLEET_REDIS_URL=settings.redis_url, TOKENFLEET_NAMESPACE=settings.namespace,
               TOKENFLEET_HEARTBEAT_S="0.5", TOKENFLEET_BLOCK_MS="20", TOKENFLEET_TORCH_THREADS="1")
    log = tmp_path / "worker.log"
    with log.open("w") as sink:
        worker = subprocess.Popen([sys.executable, "-m", "tokenfleet.cli.app", "worker",
                                   "--gpus", "none", "--model", "tiny"], env=env, cwd=ROOT,
                                  stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        served = Keys.for_url(settings.namespace, settings.redis_url).queue_workers("tiny")
        wait_until(lambda: r.zcard(served) or worker.poll() is not None, timeout=180,
                   what="a worker serving queue 'tiny'")
        assert worker.poll() is None, log.read_text()
        http = gateway(gateway_auth="off")
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
        assert answer.model == "tiny" and answer.usage is not None
        assert answer.usage.completion_tokens == 4
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=60)
