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
from fastapi.responses import Response
from hypothesis import HealthCheck, given, settings as hypothesis_settings
from hypothesis import strategies as st

from tokenfleet.aio import AsyncFleetClient
from tokenfleet.batch_client import CHAT, COMPLETIONS, endpoint_of, openai_body
from tokenfleet.batch_lines import ready
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.schemas import GenerationRequest
from tokenfleet.shared.structured import StructuredOutput

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
sampling = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.integers(1, 64),
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
})
common = {"sampling": sampling, "webhook_url": st.just("https://hooks.example.com/done"),
          "structured_output": st.sampled_from(SPECS)}


@st.composite
def requests(draw: st.DrawFn) -> GenerationRequest:
    """Any request a batch line can carry: a completion (text with or without
    a suffix, or token ids) or a chat (with metadata, or tools)."""
    if draw(st.booleans()):
        fields = draw(st.fixed_dictionaries(
            {"messages": st.lists(st.fixed_dictionaries({
                "role": st.sampled_from(["system", "user", "assistant"]), "content": words}),
                min_size=1, max_size=3)},
            optional={**common, "metadata": st.dictionaries(
                st.sampled_from(["user", "team", "trace"]), words, max_size=3)}))
        if "structured_output" not in fields and draw(st.booleans()):
            fields["tools"] = [TOOL]  # tool_choice auto: not with a constrained output
    else:
        prompt = draw(st.one_of(
            st.fixed_dictionaries({"prompt": words}, optional={"suffix": words}),
            st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 1000),
                                                                min_size=1, max_size=5)})))
        fields = {**prompt, **draw(st.fixed_dictionaries({}, optional={
            **common, "metadata": st.fixed_dictionaries({"user": words})}))}
    fields.update(draw(st.fixed_dictionaries({}, optional={
        "priority": st.sampled_from(["high", "low"]), "tenant": st.just("someone"),
        "idempotency_key": words, "deadline_s": st.floats(1, 100)})))
    return GenerationRequest.model_validate(fields)


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
    """The job the batch driver makes of the request's line."""
    endpoint = endpoint_of(request)
    made = loop.run_until_complete(ready(
        client, openai_body(request), endpoint=endpoint, batch_id="batch_x", index=0,
        tenant="acme", queues=None))
    assert not isinstance(made, Response)
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
        openai_body(GenerationRequest.model_validate(fields))


def test_the_endpoint_follows_the_request() -> None:
    assert endpoint_of(GenerationRequest(prompt="Hi")) == COMPLETIONS
    assert endpoint_of(GenerationRequest(messages=[{"role": "user", "content": "Hi"}])) == CHAT
