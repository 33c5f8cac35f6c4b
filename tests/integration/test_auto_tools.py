"""``tool_choice`` "auto" through the gateway with the official ``openai``
client: a worker whose chat template takes tools (Hermes style) says so in its
heartbeat, and its model's ``<tool_call>`` text comes back as ``tool_calls``,
whole and streamed; a model whose template takes no tools is a 400 naming
``tool_choice``. The model's text is scripted (the tiny model's own is random),
the tokenizer, the engine, Redis and the gateway are real."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from tokenfleet.shared.settings import Settings
from tokenfleet.workers.sequence import Sequence

from scripted import ScriptedRunner
from structured_helpers import serving
from tool_templates import HERMES_TEMPLATE, with_template

pytestmark = pytest.mark.timeout(120)

SAID = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def stack(redis_url: str, loaded_tiny: Any) -> Iterator[tuple[Settings, openai.OpenAI]]:
    """A worker whose tokenizer carries a tool-aware template and whose model
    says ``SAID``, a worker on the plain tiny model (queue "plain"), and the
    gateway in front of both."""
    from tokenfleet.workers.hf_engine import HFEngine
    from tokenfleet.workers.scheduler import Scheduler
    from tokenfleet.workers.service import Worker

    settings = Settings(queue="default", redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                        block_ms=20, heartbeat_s=0.5, max_batch=8, prefetch=8,
                        max_batch_tokens=8192)
    _, tiny = loaded_tiny
    tok = with_template(tiny, HERMES_TEMPLATE)
    said = tok.encode(SAID, add_special_tokens=False)
    eos = int(tok.eos_token_id)

    def next_token(seq: Sequence) -> int:
        return said[len(seq.generated)] if len(seq.generated) < len(said) else eos

    def engine(runner: Any) -> Any:
        return HFEngine(Scheduler(max_batch=8, eos_token_ids={eos}, max_model_len=2048), runner)

    plain = Worker(settings.model_copy(update={"queue": "plain"}), engine(ScriptedRunner()),
                   tiny, name="plain@test")
    plain.start()
    try:
        with serving(settings, engine(ScriptedRunner(next_token)), tok, "tools@test") as oa:
            yield settings, oa
    finally:
        plain.stop(grace_s=0)


def test_a_worker_whose_template_takes_tools_says_its_format_in_the_heartbeat(
    stack: tuple[Settings, openai.OpenAI], r: redis.Redis
) -> None:
    settings, _ = stack
    assert r.hget(f"{settings.namespace}:workers:tools@test", "tools") == b"hermes"
    assert r.hget(f"{settings.namespace}:workers:plain@test", "tools") == b""


def test_the_models_own_call_comes_back_as_tool_calls(
    stack: tuple[Settings, openai.OpenAI]
) -> None:
    _, oa = stack
    reply = oa.chat.completions.create(model="default", messages=ASK, tools=[WEATHER],
                                       max_tokens=128)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    # Without tools the same text is only text.
    plain = oa.chat.completions.create(model="default", messages=ASK, max_tokens=128)
    assert plain.choices[0].message.content == SAID and plain.choices[0].finish_reason == "stop"


def test_streamed_the_text_goes_out_first_then_the_whole_call(
    stack: tuple[Settings, openai.OpenAI]
) -> None:
    _, oa = stack
    chunks = list(oa.chat.completions.create(model="default", messages=ASK, tools=[WEATHER],
                                             max_tokens=128, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments or "") == {"city": "Oslo"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_history_is_taken_by_a_template_with_tools_and_refused_by_name_without(
    stack: tuple[Settings, openai.OpenAI]
) -> None:
    _, oa = stack
    history: Any = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    short = oa.chat.completions.create(model="default", messages=ASK, tools=[WEATHER],
                                       max_tokens=4)
    long = oa.chat.completions.create(model="default", messages=history, tools=[WEATHER],
                                      max_tokens=4)
    # The result and the earlier call are in the prompt the worker rendered.
    grew = long.usage.prompt_tokens - short.usage.prompt_tokens  # type: ignore[union-attr]
    assert grew >= len('<tool_response>sunny, 21 C</tool_response>')
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model="plain", messages=history, max_tokens=4)
    assert refused.value.body["param"] == "messages[1].tool_calls"  # type: ignore[index]


def test_auto_on_a_model_whose_template_takes_no_tools_is_a_400_naming_tool_choice(
    stack: tuple[Settings, openai.OpenAI]
) -> None:
    _, oa = stack
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as refused:
            oa.chat.completions.create(model="plain", messages=ASK, tools=[WEATHER],
                                       max_tokens=4, **extra)  # type: ignore[call-overload]
        body: Any = refused.value.body
        assert body["param"] == "tool_choice", body
        assert "chat template without tools" in body["message"], body
