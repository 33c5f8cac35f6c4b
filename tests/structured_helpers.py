"""What the structured-output tests of both engines share: a worker with the
gateway in front of it, the official ``openai`` client on it, and the fifty
schema requests each engine must answer with valid JSON."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import jsonschema
import openai

from tokenfleet.gateway.app import server_config

from gateway_server import _Server
from helpers import wait_until

# Small on purpose: the tiny model writes it in about twenty tokens.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "tag"], "additionalProperties": False}
HI = [{"role": "user", "content": "Say something."}]


@contextmanager
def serving(settings: Any, engine: Any, tokenizer: Any, name: str) -> Iterator[openai.OpenAI]:
    """A worker on ``engine`` and the gateway; yields an OpenAI client of the gateway."""
    from tokenfleet.workers.service import Worker

    worker = Worker(settings, engine, tokenizer, name=name)
    worker.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _Server(server_config(settings, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert server.ready.wait(20), "the gateway did not start"
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1",
                           api_key="unused", max_retries=0, timeout=120)
        wait_until(lambda: oa.models.list().data, timeout=30, what="the worker's heartbeat")
        yield oa
    finally:
        server.should_exit = True
        thread.join(20)
        worker.stop(grace_s=0)


def fifty_schema_answers(oa: openai.OpenAI) -> list[str]:
    """25 chats and 25 completions asking for ``SCHEMA``, all at once (one batch);
    each must finish by its grammar ("stop"). Returns their texts, each checked
    against the schema."""
    response_format: Any = {"type": "json_schema",
                            "json_schema": {"name": "flag", "schema": SCHEMA, "strict": True}}

    def chat(seed: int) -> str:
        reply = oa.chat.completions.create(model="default", messages=HI, max_tokens=48,
                                           temperature=1.0, seed=seed,
                                           response_format=response_format)
        assert reply.choices[0].finish_reason == "stop"
        return str(reply.choices[0].message.content)

    def completion(seed: int) -> str:
        # Completions take it as vLLM's server does: in the body, beside the prompt.
        reply = oa.completions.create(model="default", prompt="Data:", max_tokens=48,
                                      temperature=1.0, seed=seed,
                                      extra_body={"response_format": response_format})
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].text

    with ThreadPoolExecutor(50) as pool:
        texts = [*pool.map(chat, range(25)), *pool.map(completion, range(25, 50))]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    return texts
