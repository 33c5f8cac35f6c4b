"""OpenAI's Responses request as a chat request, with no HTTP in it (the routes:
``tokenfleet.gateway.responses``).

A response is one chat underneath: its ``instructions`` are the system message,
its ``input`` items the messages (text parts, ``function_call`` items as an
assistant's ``tool_calls``, ``function_call_output`` items as tool messages),
``previous_response_id`` puts the earlier turns first (the caller passes them
in as chat messages), and its other fields are the chat's under their chat
names (``max_output_tokens`` is ``max_completion_tokens``, ``text.format`` is
``response_format``, function tools lose one level of nesting). So the chat
route's checks, its chat template, its structured output and its tool parsing
apply unchanged, and a turn renders exactly as the chat route renders the same
messages.

What the fleet cannot do is refused naming the field: reasoning (no model here
reasons apart from its text), OpenAI's hosted tools (web and file search, code
interpreter, computer use, MCP, image generation: they run on OpenAI's side),
``truncation: "auto"``, ``conversation`` objects and reusable prompts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from tokenfleet.openai.completions import invalid
from tokenfleet.openai.errors import UNSUPPORTED, OpenAIError
from tokenfleet.openai.translate import tier
from tokenfleet.shared.wire.schemas import MAX_TOP_LOGPROBS, GenerationRequest, IntNotBool

# The Responses field a chat field's refusal is about (the chat's param as the
# caller knows it).
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
          "max_tokens": "max_output_tokens", "response_format": "text.format",
          "logprobs": "include"}
# Values of ``include`` honoured: logprobs of the output text; an encrypted
# reasoning asks for nothing here (no reasoning item is ever made).
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")
# The chat body's fields a request passes on as they are: vLLM's extensions
# the chat route takes (the seed-like ones), and the fields both APIs share.
PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "ignore_eos",
          "skip_special_tokens", "include_stop_str_in_output", "chat_template_kwargs",
          "metadata", "user", "safety_identifier", "service_tier", "parallel_tool_calls",
          "prompt_cache_key", "prompt_cache_retention", "webhook_url")
HOSTED = "OpenAI's hosted tools run on OpenAI's side; this gateway runs function tools only"
REFUSED: dict[str, str] = {
    "reasoning": "reasoning is not supported by this gateway: its models write text only, "
                 "with no separate reasoning; leave it unset",
    "conversation": "conversation is not supported by this gateway: send "
                    "previous_response_id to continue a stored response",
    "prompt": "prompt (a reusable prompt template) is not supported by this gateway: send "
              "instructions and input",
    "context_management": "context_management is not supported by this gateway: leave it "
                          "unset",
    "max_tool_calls": "max_tool_calls is not supported by this gateway: a response makes at "
                      "most the calls of one model turn; leave it unset",
}


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``' body, as the installed openai package's
    ``ResponseCreateParams`` names its fields (None: unset)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: IntNotBool | None = None
    temperature: Any = None
    top_p: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: IntNotBool | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    truncation: str | None = None
    store: StrictBool | None = None
    previous_response_id: str | None = None
    background: StrictBool | None = None
    stream: StrictBool | None = None
    stream_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    service_tier: Any = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None
    reasoning: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    max_tool_calls: Any = None
    # vLLM's extensions, as the chat route takes them.
    top_k: Any = None
    min_p: Any = None
    seed: Any = None
    stop: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    chat_template_kwargs: Any = None
    webhook_url: str | None = None

    @property
    def stored(self) -> bool:
        """OpenAI stores a response unless asked not to."""
        return self.store is not False

    @property
    def logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())


def parse(body: bytes) -> ResponsesRequest | OpenAIError:
    try:
        ask = ResponsesRequest.model_validate_json(body)
    except ValidationError as exc:
        return invalid(exc)
    return refused(ask) or ask


def refused(ask: ResponsesRequest) -> OpenAIError | None:
    """A 400 naming the first field set to something the fleet cannot honour."""
    for name, why in REFUSED.items():
        value = getattr(ask, name)
        if value is not None and value != {} and not (
                name == "reasoning" and isinstance(value, dict)
                and value.get("effort") in (None, "none")
                and all(v is None for k, v in value.items() if k != "effort")):
            return UNSUPPORTED.error(why, param=name)
    if ask.truncation not in (None, "disabled"):
        return UNSUPPORTED.error("truncation 'auto' is not supported by this gateway: an input "
                                 "over the model's length is refused, not cut; send "
                                 "'disabled' or leave it unset", param="truncation")
    for value in ask.include or ():
        if value not in INCLUDABLE:
            return UNSUPPORTED.error(f"include {value!r} is not supported by this gateway: it "
                                     "can include 'message.output_text.logprobs'",
                                     param="include")
    if ask.webhook_url is not None and not ask.background:
        return UNSUPPORTED.error("webhook_url is for background responses: a response in the "
                                 "foreground ends with its request", param="webhook_url")
    if ask.background and not ask.stored:
        return UNSUPPORTED.error("background responses are stored: send store true (or leave "
                                 "it unset) with background", param="background")
    for i, tool in enumerate(ask.tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            return UNSUPPORTED.error(f"tools[{i}] of type {kind!r} is not supported: {HOSTED}",
                                     param=f"tools[{i}]")
    fmt = (ask.text or {}).get("format")
    if (ask.text or {}).get("verbosity") not in (None, "medium"):
        return UNSUPPORTED.error("text.verbosity is not supported by this gateway: leave it "
                                 "unset", param="text.verbosity")
    if fmt is not None and (not isinstance(fmt, dict)
                            or fmt.get("type") not in ("text", "json_object", "json_schema")):
        return UNSUPPORTED.error("text.format is {'type': 'text'}, {'type': 'json_object'} or "
                                 "{'type': 'json_schema', 'name': ..., 'schema': ...}",
                                 param="text.format")
    return None


class InputRefused(ValueError):
    """An input item the fleet cannot take; the message names it."""


def input_items(ask: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(ask.input, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": ask.input}]}]
    return [dict(item) if isinstance(item, dict) else item for item in ask.input]


def messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input (or earlier output) items as chat messages: consecutive function
    calls are one assistant message's ``tool_calls``, as the chat template
    expects a turn's calls."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InputRefused(f"input[{i}] must be an object, not {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InputRefused(f"input[{i}].role must be user, system, developer or "
                                   f"assistant, not {role!r}")
            out.append({"role": role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = out[-1] if out else None
            # A turn's text and its calls are one assistant message, as the chat
            # route takes them.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, i)})
        elif kind == "reasoning":
            continue  # never made here; a client may echo a hosted model's back
        else:
            raise InputRefused(f"input[{i}] of type {kind!r} is not supported: this gateway "
                               "takes message, function_call and function_call_output items")
    return out


def _text(content: Any, i: int) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputRefused(f"input[{i}].content must be a string or a list of text parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            raise InputRefused(f"input[{i}].content holds a part of type {kind!r}: only text "
                               "parts (input_text, output_text) are supported")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the assistant's chat messages; a call
    the model did not finish (out of tokens, cancelled: its arguments cut short)
    is not part of the conversation."""
    return messages([item for item in output if item.get("type") == "message"
                     or (item.get("type") == "function_call" and item.get("status") == "completed")])


def chat_body(ask: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request a response is: ``history`` (the earlier turns, as chat
    messages) between the instructions and this request's input.

    :raises InputRefused: an input item the fleet cannot take."""
    system = [] if ask.instructions is None else [{"role": "system",
                                                   "content": ask.instructions}]
    body: dict[str, Any] = {"model": ask.model,
                            "messages": [*system, *history, *messages(input_items(ask))]}
    for name in PASSED:
        value = getattr(ask, name)
        if value is not None:
            body[name] = value
    if ask.max_output_tokens is not None:
        body["max_completion_tokens"] = ask.max_output_tokens
    if ask.tools:
        body["tools"] = [{"type": "function", "function": {
            k: v for k, v in tool.items() if k in ("name", "description", "parameters", "strict")
        }} for tool in ask.tools]
    if ask.tool_choice is not None:
        body["tool_choice"] = _tool_choice(ask.tool_choice)
    fmt = (ask.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: v for k, v in fmt.items() if k in ("name", "schema", "strict", "description")}}
    if ask.logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = ask.top_logprobs or 0
    # Never "stream": a response's whole object is built and stored however it is
    # sent, so the chat's bound on an answer's log probabilities always applies.
    return body


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def renamed(error: OpenAIError) -> OpenAIError:
    """A refusal of the chat the response is, naming the response's field."""
    inner = error.body.get("error", {})
    param = inner.get("param")
    head, dot, rest = (param or "").partition(".")
    if head in PARAMS:
        inner = {**inner, "param": PARAMS[head] + (dot + rest if head != "messages" else ""),
                 "message": inner.get("message", "").replace(f"'{head}'", f"'{PARAMS[head]}'")}
        return OpenAIError(error.status, {**error.body, "error": inner}, error.headers)
    return error


def created(response_id: str, ask: ResponsesRequest, job: GenerationRequest,
            created_at: float) -> dict[str, Any]:
    """The response object as created: what the request decided, no output yet."""
    fmt = (ask.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created_at,
        "status": "queued" if ask.background else "in_progress",
        "background": bool(ask.background), "error": None, "incomplete_details": None,
        "instructions": ask.instructions, "max_output_tokens": ask.max_output_tokens,
        "max_tool_calls": None, "model": job.model, "output": [],
        "parallel_tool_calls": ask.parallel_tool_calls is not False,
        "previous_response_id": ask.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": tier(ask.service_tier)[1], "store": ask.stored,
        "temperature": job.sampling.temperature, "top_p": job.sampling.top_p,
        "text": {"format": fmt, "verbosity": "medium"},
        "tool_choice": ask.tool_choice if ask.tool_choice is not None else "auto",
        "tools": [{"strict": True, "description": None, "parameters": None, **tool}
                  for tool in ask.tools or ()],
        "top_logprobs": ask.top_logprobs or 0, "truncation": "disabled", "usage": None,
        "user": ask.user, "safety_identifier": ask.safety_identifier,
        "prompt_cache_key": ask.prompt_cache_key, "metadata": ask.metadata or {},
        "completed_at": None}
