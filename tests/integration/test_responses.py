"""``/v1/responses`` through the gateway with the official ``openai`` client:
created, streamed (OpenAI's event names and order, each with its sequence
number), stored and read back, continued with ``previous_response_id``, listed
input items, deleted, in the background (read, resumed, cancelled), function
tools, and the fields refused by name. The models' text is scripted (the tiny
model's own is random); the tokenizer, the engine, Redis and the gateway are real."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel

from tokenfleet import AsyncFleetClient
from tokenfleet.openai.stored_responses import sweep
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.workers.sequence import Sequence

from gateway_server import gateways, sse_events
from helpers import redis_client, wait_until
from scripted import ScriptedRunner
from structured_helpers import serving
from tool_templates import HERMES_TEMPLATE, with_template

pytestmark = pytest.mark.timeout(120)

# Each job's prompt as the "default" worker's engine was given it (token ids, by job id).
PROMPTS: dict[str, list[int]] = {}

SAID = "Hello there, friend."
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def stack(redis_url: str, loaded_tiny: Any) -> Iterator[tuple[Settings, openai.OpenAI]]:
    """A worker (queue "default") whose model says ``SAID`` and ends, with a
    tool-aware template; a worker (queue "tools") whose model calls
    ``get_weather``; a worker (queue "slow") that never ends on its own; the
    gateway in front of them."""
    from tokenfleet.workers.build import grammars, hf_engine
    from tokenfleet.workers.hf_engine import HFEngine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.scheduler import Scheduler
    from tokenfleet.workers.service import Worker

    settings = Settings(queue="default", redis_url=redis_url,
                        namespace=f"t{uuid.uuid4().hex[:10]}", block_ms=20, heartbeat_s=0.5,
                        max_batch=8, prefetch=8, max_batch_tokens=16384,
                        max_prompt_tokens=16384)  # a chain of 50 turns
    model, tiny = loaded_tiny
    tok = with_template(tiny, HERMES_TEMPLATE)
    eos = int(tok.eos_token_id)

    def saying(text: str) -> Any:
        ids = tok.encode(text, add_special_tokens=False)

        def next_token(seq: Sequence) -> int:
            PROMPTS[seq.job_id] = list(seq.prompt_ids)
            return ids[len(seq.generated)] if len(seq.generated) < len(ids) else eos
        return next_token

    def slowly(seq: Sequence) -> int:
        time.sleep(0.01)  # a larger model's pace: 1024 tokens take seconds
        return 65 + len(seq.generated) % 26

    def engine(next_token: Any) -> Any:
        return HFEngine(Scheduler(max_batch=8, eos_token_ids={eos}, max_model_len=16384),
                        ScriptedRunner(next_token))

    others = [Worker(settings.model_copy(update={"queue": "tools"}), engine(saying(CALL)), tok,
                     name="tools@test"),
              Worker(settings.model_copy(update={"queue": "slow"}), engine(slowly), tok,
                     name="slow@test")]
    # The real tiny model, with xgrammar: constrained calls, parse(), logprobs.
    runner = HFRunner(model, tiny)
    real = hf_engine(settings, runner, runner.eos_token_ids, runner.max_model_len)
    real.grammars = grammars(tiny, runner.vocab_size, runner.eos_token_ids)
    others.append(Worker(settings.model_copy(update={"queue": "real"}), real, tiny,
                         name="real@test"))
    for worker in others:
        worker.start()
    try:
        with serving(settings, engine(saying(SAID)), tok, "said@test") as oa:
            wait_until(lambda: len(oa.models.list().data) == 4, timeout=30,
                       what="the four workers' heartbeats")
            yield settings, oa
    finally:
        for worker in others:
            worker.stop(grace_s=0)
        assert real.grammars is not None
        real.grammars.close()


@pytest.fixture
def http(stack: tuple[Settings, openai.OpenAI]) -> Iterator[httpx.Client]:
    _, oa = stack
    with httpx.Client(base_url=str(oa.base_url), timeout=60) as client:
        yield client


def test_a_response_is_created_stored_and_read_back(stack: tuple[Settings, openai.OpenAI]
                                                    ) -> None:
    _, oa = stack
    made = oa.responses.create(model="default", input="Say hello.", instructions="Be brief.",
                               max_output_tokens=64, metadata={"who": "test"})
    assert made.status == "completed" and made.output_text == SAID
    assert made.id.startswith("resp_") and made.object == "response"
    assert made.instructions == "Be brief." and made.metadata == {"who": "test"}
    assert made.usage is not None and made.usage.output_tokens > 0
    assert made.usage.total_tokens == made.usage.input_tokens + made.usage.output_tokens
    read = oa.responses.retrieve(made.id)
    assert read.model_dump() == made.model_dump()
    items = oa.responses.input_items.list(made.id)
    assert [i.type for i in items.data] == ["message"]
    assert items.data[0].content[0].text == "Say hello."  # type: ignore[union-attr]


def test_out_of_tokens_is_incomplete(stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    made = oa.responses.create(model="default", input="Say hello.", max_output_tokens=2)
    assert made.status == "incomplete"
    assert made.incomplete_details is not None
    assert made.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response_sends_openais_events_in_order(
        stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    events = list(oa.responses.create(model="default", input="Say hello.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == SAID
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == SAID
    # Stored: the same object is read back.
    assert oa.responses.retrieve(final.id).model_dump() == final.model_dump()


def test_the_stream_helper_and_its_final_response(stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    with oa.responses.stream(model="default", input="Say hello.") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == SAID == final.output_text


def test_a_stream_resumes_after_any_sequence_number(http: httpx.Client) -> None:
    with http.stream("POST", "/responses", json={"model": "default", "input": "Say hello.",
                                                 "stream": True}) as got:
        whole = [json.loads(e["data"]) for e in sse_events(got.iter_lines())]
    rid = whole[0]["response"]["id"]
    for after in range(-1, len(whole)):
        with http.stream("GET", f"/responses/{rid}",
                         params={"stream": "true", "starting_after": after}) as got:
            resumed = [json.loads(e["data"]) for e in sse_events(got.iter_lines())]
        assert resumed == whole[after + 1:]


def test_previous_response_id_continues_the_conversation(
        stack: tuple[Settings, openai.OpenAI], http: httpx.Client) -> None:
    _, oa = stack
    first = oa.responses.create(model="default", input="Say hello.", instructions="Be brief.")
    second = oa.responses.create(model="default", input="Again.",
                                 previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.status == "completed"
    # The second turn's prompt holds the first turn and its answer.
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    items = oa.responses.input_items.list(second.id, order="asc")
    assert [i.content[0].text for i in items.data] == ["Again."]  # type: ignore[union-attr]
    oa.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as refused:
        oa.responses.create(model="default", input="Once more.", previous_response_id=first.id)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert first.id in refused.value.body["message"]  # type: ignore[index]


def test_twenty_turns_across_two_gateways_render_as_the_chat_route_renders(
        stack: tuple[Settings, openai.OpenAI]) -> None:
    settings, oa = stack
    keys, r = Keys(settings.namespace), redis_client(settings.redis_url)
    with gateways(settings) as start:
        other = openai.OpenAI(base_url=f"{start().base_url}/v1", api_key="unused",
                              max_retries=0, timeout=60)
        messages: list[Any] = [{"role": "system", "content": "Be brief."}]
        previous = None
        for turn in range(20):
            here = (oa, other)[turn % 2]  # each turn on the other gateway
            made = here.responses.create(model="default", input=f"Turn {turn}.",
                                         instructions="Be brief.", max_output_tokens=16,
                                         previous_response_id=previous)
            assert made.status == "completed", made
            messages.append({"role": "user", "content": f"Turn {turn}."})
            chat = here.chat.completions.create(model="default", messages=messages,
                                                max_tokens=16)
            job_id = json.loads(r.get(keys.response(made.id)))["job_id"]
            assert PROMPTS[job_id] == PROMPTS[chat.id.removeprefix("chatcmpl-")], turn
            messages.append({"role": "assistant", "content": made.output_text})
            previous = made.id
    r.close()


def test_a_chain_of_50_turns(stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    previous = None
    for turn in range(50):
        made = oa.responses.create(model="default", input=f"Turn {turn}.",
                                   previous_response_id=previous, max_output_tokens=16)
        assert made.status == "completed", turn
        previous = made.id
    # The last turn's prompt holds every turn before it, and their answers.
    assert made.usage is not None and made.usage.input_tokens > 50 * 4


def test_a_deleted_response_is_gone(stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    made = oa.responses.create(model="default", input="Say hello.")
    oa.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(made.id)


def test_a_response_not_stored_cannot_be_read(stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    made = oa.responses.create(model="default", input="Say hello.", store=False)
    assert made.output_text == SAID and made.store is False
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(made.id)


def test_a_background_response_is_queued_then_read_when_done(
        stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    made = oa.responses.create(model="default", input="Say hello.", background=True)
    assert made.status in ("queued", "in_progress") and made.background is True
    wait_until(lambda: oa.responses.retrieve(made.id).status == "completed", timeout=30,
               what="the background response to complete")
    assert oa.responses.retrieve(made.id).output_text == SAID


def test_a_background_response_is_cancelled(stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    made = oa.responses.create(model="slow", input="Go on.", background=True,
                               max_output_tokens=1024)
    wait_until(lambda: oa.responses.retrieve(made.id).status == "in_progress", timeout=30,
               what="the response to start")
    cancelled = oa.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    assert oa.responses.retrieve(made.id).status == "cancelled"


def test_a_background_response_whose_gateway_stopped_is_stored_by_a_sweep(
        stack: tuple[Settings, openai.OpenAI]) -> None:
    settings, _ = stack
    keys, r = Keys(settings.namespace), redis_client(settings.redis_url)
    with gateways(settings) as start:
        made = start().post("/v1/responses", json={
            "model": "slow", "input": "Go on.", "background": True, "max_output_tokens": 300})
        rid = made.json()["id"]
    # That gateway is gone before the response ended, and its finisher with it.
    job_id = json.loads(r.get(keys.response(rid)))["job_id"]
    wait_until(lambda: r.hget(keys.job(job_id), "status") == b"succeeded", timeout=60,
               what="the response's job to end")
    assert json.loads(r.get(keys.response(rid)))["final"] is None

    async def swept() -> int:
        async with AsyncFleetClient(settings=settings) as client:
            return await sweep(client, now=time.time() + 3600)  # every entry is due

    assert asyncio.run(swept()) >= 1
    final = json.loads(r.get(keys.response(rid)))["final"]
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["usage"]["output_tokens"] == 300
    assert r.zscore(keys.responses_pending(), rid) is None
    r.close()


def test_once_its_jobs_log_expired_a_response_streams_from_its_final_object(
        stack: tuple[Settings, openai.OpenAI], http: httpx.Client) -> None:
    settings, oa = stack
    keys, r = Keys(settings.namespace), redis_client(settings.redis_url)
    made = oa.responses.create(model="default", input="Say hello.")
    events = stream_of(http, made.id)
    job_id = json.loads(r.get(keys.response(made.id)))["job_id"]
    r.delete(keys.job(job_id), keys.out(job_id))  # what its TTL does after a day
    replayed = stream_of(http, made.id)
    assert replayed[-1] == events[-1]
    assert "".join(e["delta"] for e in replayed if e["type"] == "response.output_text.delta") \
        == SAID
    # A client that saw all but the end gets the end.
    assert stream_of(http, made.id, after=events[-2]["sequence_number"]) == [events[-1]]
    assert oa.responses.retrieve(made.id).output_text == SAID
    r.close()


def stream_of(http: httpx.Client, rid: str, after: int = -1) -> list[dict[str, Any]]:
    with http.stream("GET", f"/responses/{rid}",
                     params={"stream": "true", "starting_after": after}) as got:
        return [json.loads(e["data"]) for e in sse_events(got.iter_lines())]


def test_a_foreground_response_cannot_be_cancelled(stack: tuple[Settings, openai.OpenAI]
                                                   ) -> None:
    _, oa = stack
    made = oa.responses.create(model="default", input="Say hello.")
    with pytest.raises(openai.BadRequestError):
        oa.responses.cancel(made.id)


def test_a_required_function_call(stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    made = oa.responses.create(model="real", input="Weather in Oslo?", tools=[WEATHER],
                               tool_choice={"type": "function", "name": "get_weather"},
                               max_output_tokens=64, temperature=0)
    calls = [item for item in made.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)  # the parameters' schema
    streamed = list(oa.responses.create(
        model="real", input="Weather in Oslo?", tools=[WEATHER], stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
        temperature=0))
    arguments = "".join(e.delta for e in streamed
                        if e.type == "response.function_call_arguments.delta")
    assert arguments == calls[0].arguments


class Flag(BaseModel):
    on: bool


def test_parse_gets_an_object_of_the_pydantic_model(stack: tuple[Settings, openai.OpenAI]
                                                    ) -> None:
    _, oa = stack
    parsed = oa.responses.parse(model="real", input="A flag, please.", text_format=Flag,
                                max_output_tokens=64)
    assert isinstance(parsed.output_parsed, Flag)


def test_logprobs_of_the_output_text(stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    made = oa.responses.create(model="real", input="Hi", max_output_tokens=8, top_logprobs=2,
                               include=["message.output_text.logprobs"])
    part = made.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and len(part.logprobs) == made.usage.output_tokens  # type: ignore[union-attr]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)


def test_the_models_own_call_and_its_output_in_the_next_turn(
        stack: tuple[Settings, openai.OpenAI]) -> None:
    _, oa = stack
    made = oa.responses.create(model="tools", input="Weather in Oslo?", tools=[WEATHER])
    calls = [item for item in made.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                   {"city": "Oslo"})]
    streamed = list(oa.responses.create(model="tools", input="Weather in Oslo?",
                                        tools=[WEATHER], stream=True))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.done" in kinds
    done = [e for e in streamed if e.type == "response.output_item.done"]
    assert done[-1].item.type == "function_call"  # type: ignore[union-attr]
    # The call's output goes back as an input item of the next turn.
    answer = oa.responses.create(
        model="default", previous_response_id=made.id, tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny"}])
    assert answer.status == "completed"


@pytest.mark.parametrize("field, value, param", [
    ("reasoning", {"effort": "high"}, "reasoning"),
    ("reasoning", {"summary": "auto"}, "reasoning"),
    ("tools", [{"type": "web_search"}], "tools[0]"),
    ("truncation", "auto", "truncation"),
    ("include", ["file_search_call.results"], "include"),
])
def test_what_the_fleet_cannot_do_is_refused_by_name(
        stack: tuple[Settings, openai.OpenAI], field: str, value: Any, param: str) -> None:
    _, oa = stack
    with pytest.raises(openai.BadRequestError) as refused:
        oa.responses.create(model="default", input="Hi", **{field: value})
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_an_unknown_response_is_a_404_in_openais_shape(http: httpx.Client) -> None:
    got = http.get("/responses/resp_nothing")
    assert got.status_code == 404
    assert got.json()["error"]["code"] == "not_found"
