"""OpenAI's chat request as the fleet's jobs, and their answer, with no HTTP in it
(the route: ``tokenfleet.gateway.chat``; a batch's lines go through
:func:`chat_request` too): the messages go on the queue as they are, and the
worker renders them with its tokenizer's chat template.

A queue whose live workers have no chat template is refused here with a 400,
before anything is enqueued (workers say so in their heartbeat). As for
completions, every field is honoured or refused naming it: ``n`` fans the
request out to n jobs, one per choice; ``logprobs`` with ``top_logprobs`` (0 to
20) are honoured; ``response_format``, ``structured_outputs`` and ``tools``
(with ``tool_choice`` "required" or a named function) constrain the output
(``tokenfleet.openai.structured``); with ``tool_choice`` "auto" the tools go to
the chat template and the model's own calls are parsed from its text, and
``tool`` messages and an assistant's ``tool_calls`` are rendered as tool
history, where the template takes tools; a message's ``name`` goes to the
template, which may show it (``tokenfleet.openai.tools``); audio and the like are refused unless they
ask for nothing; ``user``, ``safety_identifier`` and ``metadata`` are kept in
the job's metadata; ``developer`` messages are system messages.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.openai.answer import events, finish, shaped, usage
from tokenfleet.openai.completions import Sampling, invalid, refusal
from tokenfleet.openai.errors import INVALID_VALUE, NO_CHAT_TEMPLATE, OpenAIError
from tokenfleet.openai.logprobs import chat_logprobs, over_budget
from tokenfleet.openai.structured import StructuredRefused, ToolCall, asks_auto, requested, tool_call
from tokenfleet.openai.translate import CHAT_PARAMS, SERVICE_TIERS, chat_job, tier
from tokenfleet.openai.tools import (
    auto_message,
    auto_refusal,
    history_call,
    history_refusal,
)
from tokenfleet.client.served import served
from tokenfleet.shared.wire.schemas import MAX_TOP_LOGPROBS, GenerationRequest, IntNotBool, JobState
from tokenfleet.shared.wire.structured import StructuredOutput

REFUSED: dict[str, tuple[tuple[Any, ...], str | None]] = {
    # One call per response: parallel calls allowed or not, the answer fits.
    "parallel_tool_calls": ((None, True, False), None),
    "functions": ((None, []), "functions are not supported by this gateway: send tools "
                  "instead"),
    "function_call": ((None, "none"), "function_call is not supported: send tools and "
                      "tool_choice instead"),
    "modalities": ((None, ["text"]), "modalities other than [\"text\"] are not supported: this "
                   "gateway writes text only"),
    "audio": ((None,), "audio is not supported by this gateway: it writes text only; leave it "
              "unset"),
    "prediction": ((None,), None),
    "reasoning_effort": ((None,), None),
    "verbosity": ((None,), None),
    "web_search_options": ((None,), None),
    "service_tier": ((None, *(SERVICE_TIERS)), "service_tier is 'auto', 'default', 'flex' (the "
                     "fleet's batch level: the slots live jobs leave, preemptible) or "
                     "'priority' (its high level) here; OpenAI's 'scale' and 'fast' are not "
                     "supported"),
    "prompt_cache_retention": ((None, "in_memory"), "prompt_cache_retention '24h' is not "
                               "supported: the fleet keeps nothing of a prompt beyond its "
                               "workers' memory; leave it unset or 'in_memory'"),
    "prompt_cache_options": ((None, {}), "prompt_cache_options is not supported: cache "
                             "breakpoints are not set by request here; leave it unset"),
    "moderation": ((None,), "moderation is not supported by this gateway: it runs no "
                   "moderation model; leave it unset"),
    "store": ((None, False), "store is not supported: stored completions are not kept; leave "
              "it unset or false"),
}
# Fields of a message that only functions, audio or refusals use.
MESSAGE_REFUSED = ("function_call", "audio", "refusal")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    audio: Any = None
    refusal: Any = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, value: str) -> str:
        if value == "function":
            raise ValueError("'function' messages are not supported: send tool messages "
                             "(role 'tool' with tool_call_id) instead")
        if value not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"{value!r} is not a role: system, developer, user, assistant or "
                             "tool")
        return value

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: str | list[Any] | None) -> str | list[Any] | None:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) "
                                 f"are supported, not {kind or type(part).__name__!r}")
        return value

    @model_validator(mode="after")
    def _nothing_unsupported(self) -> Message:
        for name in MESSAGE_REFUSED:
            if getattr(self, name) is not None:
                raise ValueError(f"'{name}' in a message is not supported by this gateway")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("'tool_calls' belong to assistant messages only")
        if self.tool_calls is not None:
            self.tool_calls = [history_call(i, call) for i, call in enumerate(self.tool_calls)]
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs 'tool_call_id' (the call it answers), and "
                             "only a tool message has one")
        if self.tool_call_id is not None and not isinstance(self.tool_call_id, str):
            raise ValueError("'tool_call_id' must be a string")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is missing: every message needs its text")
        return self


class ChatRequest(Sampling):
    ROUTE = "chat"

    messages: list[Message]
    max_tokens: IntNotBool | None = None
    max_completion_tokens: IntNotBool | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    logprobs: StrictBool | None = None
    top_logprobs: IntNotBool | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    service_tier: Any = None
    store: Any = None
    # vLLM's: how the chat template renders the messages (GenerationRequest's).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self


def constrained(ask: ChatRequest) -> tuple[StructuredOutput | None, str | None,
                                            ToolCall | None]:
    """What the chat's output must be, the field that asks it, and the tool
    call it makes, if any; ``Refused`` naming a field that cannot be honoured."""
    call = tool_call(ask.tools, ask.tool_choice)
    structured, field = requested(ask)
    if structured is not None and asks_auto(ask.tools, ask.tool_choice):
        raise StructuredRefused(field or "response_format", f"{field} cannot go with tool_choice 'auto': "
                                "constrained, the model could not write its own tool calls; send "
                                "tool_choice 'required' or 'none'")
    if call is None:
        return structured, field, None
    if structured is not None:
        raise StructuredRefused(field or "response_format", f"{field} cannot go with a tool call: the "
                                "call's arguments follow the function's parameters")
    return call.spec, "tools", call


def chat_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": {"content": text} if text else {},
            "finish_reason": finish_reason, "logprobs": None}


OPENING = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
           "logprobs": None}


@dataclass(frozen=True)
class Chat:
    """A chat request checked as the endpoint checks it: the job it makes, how
    many choices, and what the answer's shape depends on (a constrained tool
    call; the queue's tool-call format where the model writes its own calls)."""

    ask: ChatRequest
    job: GenerationRequest
    n: int
    call: ToolCall | None
    fmt: Any
    field: str | None = None  # the field that asked for structured output, if any

    def head(self, first_job_id: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{first_job_id}", "created": int(time.time()),
                "model": self.job.model, "service_tier": tier(self.ask.service_tier)[1]}


async def chat_request(client: AsyncFleetClient, body: bytes) -> Chat | OpenAIError:
    """The chat in ``body`` as the fleet's job, or the 400 (404) that refuses it:
    the one check both the endpoint and a batch's lines go through."""
    try:
        ask = ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        return invalid(exc)
    n = ask.choices(client.settings)
    if isinstance(n, OpenAIError):
        return n
    refused = refusal(ask, REFUSED)
    if refused is not None:
        return refused
    try:
        structured, field, call = constrained(ask)
    except StructuredRefused as exc:
        return exc.error()
    try:
        # Only "auto" shows the template the tools: a constrained call writes
        # bare arguments, not the model's own call format.
        job = chat_job(ask, client.settings, structured,
                       ask.tools if asks_auto(ask.tools, ask.tool_choice) else None)
    except ValidationError as exc:
        params = CHAT_PARAMS if ask.max_completion_tokens is not None else {
            **CHAT_PARAMS, ("sampling", "max_new_tokens"): "max_tokens"}
        return invalid(exc, {**params, ("structured_output",): field or "response_format"})
    if ask.logprobs and not ask.stream:
        why = over_budget(n, job.sampling.max_new_tokens, (ask.top_logprobs or 0) + 1,
                          client.settings, "top_logprobs")
        if why is not None:
            return INVALID_VALUE.error(why, param="top_logprobs")
    queue = await served(client, job.model)
    if queue is not None and queue.chat is False:
        return NO_CHAT_TEMPLATE.error(
            f"model {job.model!r} has no chat template (its tokenizer defines none), so it "
            "cannot take messages: send a prompt to /v1/completions instead, or serve a model "
            "with a chat template", param="model")
    auto = asks_auto(ask.tools, ask.tool_choice)
    refused = (auto_refusal(queue, job.model, "tool_choice" if ask.tool_choice else "tools")
               if auto else None) or history_refusal(queue, job.model, ask.messages)
    if refused is not None:
        return refused
    return Chat(ask, job, n, call, queue.tools if auto and queue is not None else None, field)


async def chat_answer(client: AsyncFleetClient, made: Chat, job_ids: list[str],
                      states: list[JobState]) -> dict[str, Any]:
    """The endpoint's answer (not streamed) for the succeeded jobs of ``made``."""
    return await shaped(client, job_ids, bool(made.ask.logprobs),
                        functools.partial(chat_body, made, job_ids, states))


def chat_body(made: Chat, job_ids: list[str], states: list[JobState],
              logs: list[list[bytes]] | None) -> dict[str, Any]:
    """The answer for the jobs' states, and their token logs' entries when the
    request asked for log probabilities."""
    choices = []
    for i, state in enumerate(states):
        message: dict[str, Any] = {"role": "assistant", "content": state.text, "refusal": None}
        finish_reason = finish(state)
        calls = made.call.calls(state.text) if made.call is not None else None
        if made.fmt:
            message, finish_reason = auto_message(made.fmt, state.text, finish_reason)
        elif calls is not None:
            message.update(content=None, tool_calls=calls)
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choices.append({"index": i, "message": message, "finish_reason": finish_reason,
                        "logprobs": None if logs is None
                        else chat_logprobs(made.ask.named(events(logs[i])))})
    return {**made.head(job_ids[0]), "object": "chat.completion", "choices": choices,
            "usage": usage(states)}
