"""A ``GenerationRequest`` given to ``submit_batch`` keeps every field: its
line's body, checked as the endpoint checks a request (the batch driver's own
check), is the same request again, but for what the batch sets itself
(priority, tenant, idempotency key, deadline). A field the body cannot carry
is refused by name, never left out. On a real redis-server, with a worker
registered that takes chats, insert mode and tools."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings as hypothesis_settings
from hypothesis import strategies as st

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.client.batches import CHAT, COMPLETIONS, endpoint_of, line_of
from tokenfleet.batches.lines import LineError, parse, ready
from tokenfleet.openai.translate import to_body
from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.wire.schemas import GenerationRequest, SamplingParams
from tokenfleet.shared.wire.structured import StructuredOutput

from gateway_server import pin_live_worker

pytestmark = pytest.mark.timeout(300)

# What the batch sets on each line's job, whatever the request said.
BATCH_SET = {"priority", "tenant", "idempotency_key", "deadline_s"}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "find a word",
                                         "parameters": {"type": "object", "properties": {
                                             "word": {"type": "string"}}}}}
SPECS = [StructuredOutput(kind="json_object"),
         StructuredOutput(kind="json_schema", json_schema={"type": "object"}),
         StructuredOutput(kind="json_schema", name="answer",
                          json_schema={"type": "object", "properties": {"a": {"type": "integer"}}}),
         StructuredOutput(kind="regex", regex="[a-z]{1,8}"),
         StructuredOutput(kind="choice", choice=["yes", "no"]),
         StructuredOutput(kind="grammar", grammar='root ::= "yes" | "no"')]

words = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), min_size=1, max_size=12)
sampling_fields = {
    "max_new_tokens": st.integers(1, 64),
    "min_tokens": st.integers(0, 64),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**62),
    "stop": st.lists(words, max_size=3),
    "repetition_penalty": st.floats(0.5, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=3),
    "min_p": st.floats(0, 1),
    "logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
sampling = st.fixed_dictionaries({}, optional=sampling_fields)
# Only a completion's line carries the prompt's log probabilities.
completion_sampling = st.fixed_dictionaries({}, optional={
    **sampling_fields, "prompt_logprobs": st.integers(0, 5)})
common = {"sampling": sampling, "webhook_url": st.just("https://hooks.example.com/done"),
          "structured_output": st.sampled_from(SPECS),
          "prompt_cache_key": st.sampled_from(["user-42", "agent-7"])}


@st.composite
def requests(draw: st.DrawFn) -> GenerationRequest:
    """Any request a batch line can carry: a completion (text with or without
    a suffix, or token ids) or a chat (with metadata, or tools)."""
    if draw(st.booleans()):
        fields = draw(st.fixed_dictionaries(
            {"messages": st.lists(st.fixed_dictionaries({
                "role": st.sampled_from(["system", "user", "assistant"]), "content": words},
                optional={"name": words}), min_size=1, max_size=3)},
            optional={**common, "metadata": st.dictionaries(
                st.sampled_from(["user", "team", "trace"]), words, max_size=3),
                "chat_template_kwargs": st.dictionaries(
                    st.sampled_from(["enable_thinking", "style"]), st.booleans(), max_size=2),
                "add_generation_prompt": st.just(False)}))
        if fields.get("add_generation_prompt") is False and draw(st.booleans()):
            fields["messages"].append({"role": "assistant", "content": "Well,"})
            fields["continue_final_message"] = True
        if "structured_output" not in fields and draw(st.booleans()):
            fields["tools"] = [TOOL]  # tool_choice auto: not with a constrained output
    else:
        prompt = draw(st.one_of(
            st.fixed_dictionaries({"prompt": words}, optional={"suffix": words}),
            st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 1000),
                                                                min_size=1, max_size=5)})))
        fields = {**prompt, **draw(st.fixed_dictionaries({}, optional={
            **common, "sampling": completion_sampling,
            "metadata": st.fixed_dictionaries({"user": words})}))}
    fields.update(draw(st.fixed_dictionaries({}, optional={
        "priority": st.sampled_from(["high", "low"]), "tenant": st.just("someone"),
        "idempotency_key": words, "deadline_s": st.floats(1, 100)})))
    return GenerationRequest.model_validate(fields)


def test_the_requests_drawn_set_every_field_a_line_can_carry() -> None:
    # A new field of GenerationRequest or SamplingParams must be drawn above (or
    # named here as one the batch sets, or no line can carry): else the
    # property test below would pass without it.
    drawn = {"prompt", "messages", "prompt_token_ids", "suffix", "sampling", "model",
             "metadata", "structured_output", "tools", "webhook_url", "chat_template_kwargs",
             "add_generation_prompt", "continue_final_message", "prompt_cache_key"}
    not_a_line = {"response_id"}  # the Responses route's: refused by to_body
    assert set(GenerationRequest.model_fields) == drawn | BATCH_SET | not_a_line
    sampled = {"max_new_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop",
               "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
               "min_p", "logprobs", "ignore_eos", "include_stop_str_in_output",
               "skip_special_tokens", "prompt_logprobs"}
    one_choice = {"choice_index"}  # a line is one choice: refused by to_body
    assert set(SamplingParams.model_fields) == sampled | one_choice


@pytest.fixture
def loop_client(settings: Any, r: redis.Redis) -> Iterator[tuple[asyncio.AbstractEventLoop,
                                                                 AsyncFleetClient]]:
    pin_live_worker(r, settings.namespace, "default", chat="1", fim="1", tools="hermes")
    for spec in SPECS:  # compiled once here (a first compile loads the compiler)
        GenerationRequest(prompt="Hi", structured_output=spec)
    loop = asyncio.new_event_loop()
    client = AsyncFleetClient(settings=settings)
    yield loop, client
    loop.run_until_complete(client.close())
    loop.close()


def checked(loop: asyncio.AbstractEventLoop, client: AsyncFleetClient,
            request: GenerationRequest) -> GenerationRequest:
    """The job the batch driver makes of the request's line, as submit_batch writes
    it (the request as it is) and the driver reads it."""
    endpoint = endpoint_of(request)
    parsed = parse(line_of(0, request, endpoint), endpoint)
    assert isinstance(parsed.body, dict), f"the line has no body: {parsed.body}"
    made = loop.run_until_complete(ready(
        client, parsed.body, endpoint=endpoint, batch_id="batch_x", index=0,
        tenant="acme", queues=None))
    assert hasattr(made, "job"), f"the line was refused: {made}"
    return made.job


@hypothesis_settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])
@given(request=requests())
def test_a_generation_request_in_a_batch_keeps_every_field(
    loop_client: tuple[asyncio.AbstractEventLoop, AsyncFleetClient], request: GenerationRequest
) -> None:
    job = checked(*loop_client, request)
    assert job.model_dump(exclude=BATCH_SET) == request.model_dump(exclude=BATCH_SET)
    assert (job.priority, job.tenant) == ("batch", "acme")


@pytest.mark.parametrize(("fields", "named"), [
    ({"prompt": "Hi", "metadata": {"team": "a"}}, "metadata"),
    ({"messages": [{"role": "user", "content": "Hi"}], "metadata": {"n": 3}}, "metadata"),
])
def test_a_field_a_line_cannot_carry_is_refused_by_name(fields: dict[str, Any],
                                                        named: str) -> None:
    with pytest.raises(InvalidRequest, match=f"^{named}:"):
        to_body(GenerationRequest.model_validate(fields))
    # A line written with it fails alone, naming it, when the driver reads it.
    request = GenerationRequest.model_validate(fields)
    endpoint = endpoint_of(request)
    error = parse(line_of(0, request, endpoint), endpoint).body
    assert isinstance(error, LineError) and error.message.startswith(f"{named}:")


def test_the_endpoint_follows_the_request() -> None:
    assert endpoint_of(GenerationRequest(prompt="Hi")) == COMPLETIONS
    assert endpoint_of(GenerationRequest(messages=[{"role": "user", "content": "Hi"}])) == CHAT
    # A line as a dict, written with the fleet's request rather than a body.
    assert endpoint_of({"request": {"messages": [{"role": "user", "content": "Hi"}]}}) == CHAT
    assert endpoint_of({"request": {"prompt": "Hi"}}) == COMPLETIONS
