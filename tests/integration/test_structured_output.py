"""Structured output and tool calls on the built-in engine: the official
``openai`` client against the gateway, a worker on the tiny model, a real
redis-server. One worker and one gateway serve the whole module."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
import redis

from tokenfleet import FleetClient, JobStatus
from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.settings import Settings

from structured_helpers import HI, SCHEMA, fifty_schema_answers, serving

pytestmark = pytest.mark.timeout(180)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1,
                                                             "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
PARAMETERS = {"get_weather": WEATHER["function"]["parameters"],
              "get_time": TIME["function"]["parameters"]}


@pytest.fixture(scope="module")
def stack(redis_url: str, loaded_tiny: Any) -> Iterator[tuple[Settings, openai.OpenAI]]:
    """A worker on the tiny model (with xgrammar) and the gateway in front of it."""
    from tokenfleet.workers.build import grammars, hf_engine
    from tokenfleet.workers.runner import HFRunner

    settings = Settings(queue="default", redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                        block_ms=20, heartbeat_s=0.5, max_batch=64, prefetch=64,
                        max_batch_tokens=262_144)
    model, tokenizer = loaded_tiny
    runner = HFRunner(model, tokenizer)
    engine = hf_engine(settings, runner, runner.eos_token_ids, runner.max_model_len)
    engine.grammars = grammars(tokenizer, runner.vocab_size, runner.eos_token_ids)
    try:
        with serving(settings, engine, tokenizer, "json@test") as oa:
            yield settings, oa
    finally:
        if engine.grammars is not None:
            engine.grammars.close()


def test_the_openai_client_gets_json_valid_against_its_schema_50_of_50(
    stack: tuple[Settings, openai.OpenAI]
) -> None:
    _, oa = stack
    texts = fifty_schema_answers(oa)
    assert len(set(texts)) > 1  # sampled, not one fixed answer


def test_json_mode_and_vllms_structured_outputs_constrain_the_text(
    stack: tuple[Settings, openai.OpenAI]
) -> None:
    _, oa = stack
    mode = oa.chat.completions.create(model="default", messages=HI, max_tokens=64, seed=3,
                                      response_format={"type": "json_object"})
    if mode.choices[0].finish_reason == "stop":  # a random model may nest past 64 tokens
        assert isinstance(json.loads(str(mode.choices[0].message.content)), dict)
    else:
        assert str(mode.choices[0].message.content).startswith("{")
    choice = oa.completions.create(model="default", prompt="Pick:", max_tokens=16, seed=1,
                                   extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    regex = oa.chat.completions.create(model="default", messages=HI, max_tokens=16, seed=2,
                                       extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert len(str(regex.choices[0].message.content)) == 3
    assert str(regex.choices[0].message.content).isdigit()


def test_tool_choice_required_returns_tool_calls_whose_arguments_fit_the_schema(
    stack: tuple[Settings, openai.OpenAI]
) -> None:
    _, oa = stack
    asks: list[tuple[list[Any], Any]] = [
        ([WEATHER], "required"),
        ([WEATHER, TIME], "required"),  # of two tools, "required" picks one
        ([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}),
    ]
    with ThreadPoolExecutor(len(asks)) as pool:
        replies = list(pool.map(lambda ask: oa.chat.completions.create(
            model="default", messages=HI, max_tokens=64, seed=5, tools=ask[0],
            tool_choice=ask[1]), asks))
    for reply in replies:
        assert reply.choices[0].finish_reason == "tool_calls"
        message = reply.choices[0].message
        assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert replies[0].choices[0].message.tool_calls[0].function.name == "get_weather"
    assert replies[2].choices[0].message.tool_calls[0].function.name == "get_time"


def test_a_streamed_tool_call_comes_as_deltas_that_add_up_to_the_call(
    stack: tuple[Settings, openai.OpenAI]
) -> None:
    _, oa = stack

    def streamed(tools: list[Any]) -> list[Any]:
        return list(oa.chat.completions.create(model="default", messages=HI, max_tokens=64,
                                               seed=8, tools=tools, tool_choice="required",
                                               stream=True))

    with ThreadPoolExecutor(2) as pool:
        one, two = pool.map(streamed, ([WEATHER], [WEATHER, TIME]))
    for chunks in (one, two):
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        name = next(d.function.name for d in deltas if d.function and d.function.name)
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # A fixed function's arguments stream as they are written: several deltas.
    assert len([c for c in one if c.choices and c.choices[0].delta.tool_calls]) > 2


def test_what_cannot_be_honoured_is_a_400_naming_it_and_nothing_is_queued(
    stack: tuple[Settings, openai.OpenAI], r: redis.Redis
) -> None:
    settings, oa = stack
    before = set(r.scan_iter(match=f"{settings.namespace}:job:*"))
    bad_schema: Any = {"type": "json_schema",
                       "json_schema": {"name": "broken", "schema": {"type": "objectx"}}}
    cases: list[tuple[str, Any, str]] = [
        ("response_format", lambda: oa.chat.completions.create(
            model="default", messages=HI, response_format=bad_schema),
         "json_schema 'broken' cannot be compiled: Unsupported type \"objectx\""),
        ("response_format", lambda: oa.completions.create(
            model="default", prompt="x", extra_body={"response_format": bad_schema}),
         "json_schema 'broken' cannot be compiled"),
        ("structured_outputs", lambda: oa.completions.create(
            model="default", prompt="x", extra_body={"structured_outputs": {"regex": "a(b"}}),
         "regex cannot be compiled"),
        ("structured_outputs", lambda: oa.completions.create(
            model="default", prompt="x",
            extra_body={"structured_outputs": {"structural_tag": "{}"}}),
         "structured_outputs.structural_tag is not supported"),
        ("guided_json", lambda: oa.completions.create(
            model="default", prompt="x", extra_body={"guided_json": SCHEMA}),
         "send structured_outputs {\"json\": ...}"),
        ("tools", lambda: oa.chat.completions.create(
            model="default", messages=HI, tool_choice="required", tools=[
                {"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "objectx"}}}]),
         "parameters of f' cannot be compiled"),
        # The tiny model's chat template takes no tools: "auto" (the default) cannot be served.
        ("tool_choice", lambda: oa.chat.completions.create(model="default", messages=HI,
                                                           tools=[WEATHER]),
         "has a chat template without tools"),
        ("tool_choice", lambda: oa.chat.completions.create(
            model="default", messages=HI, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice names function 'nope', which is not among the tools"),
        ("response_format", lambda: oa.chat.completions.create(
            model="default", messages=HI, tools=[WEATHER], tool_choice="required",
            response_format={"type": "json_object"}),
         "response_format cannot go with a tool call"),
    ]
    for param, call, sentence in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == param, (param, refused.value.message)
        assert sentence in refused.value.message, refused.value.message
    assert set(r.scan_iter(match=f"{settings.namespace}:job:*")) == before


def test_submit_takes_a_json_schema_and_response_format_and_refuses_a_broken_one(
    stack: tuple[Settings, openai.OpenAI]
) -> None:
    settings, _ = stack
    with FleetClient(settings=settings) as client:
        state = client.wait(client.submit("Data:", max_new_tokens=48, json_schema=SCHEMA,
                                          seed=4), timeout=60)
        assert state.status is JobStatus.SUCCEEDED and state.finish_reason.value == "eos"
        jsonschema.validate(json.loads(state.text), SCHEMA)
        choice = client.wait(client.submit("Pick:", max_new_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [1, 2]}}}),
            timeout=60)
        assert json.loads(choice.text) in (1, 2)
        with pytest.raises(InvalidRequest, match="'structured_output': json_schema 'bad' cannot"):
            client.submit("x", response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "objectx"}}})
        with pytest.raises(InvalidRequest, match="give at most one of response_format, "
                                                 "json_schema"):
            client.submit("x", json_schema=SCHEMA, response_format={"type": "json_object"})
