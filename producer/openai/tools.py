"""``tool_choice`` "auto" and tool history at the chat route: whether the
queue's model can take them, and its own tool calls back in OpenAI's shape.

The worker's heartbeat says which tool-call format its chat template declares
(``Served.tools``), so both are decided before a job is queued: "auto" needs a
format this gateway parses (``tokenfleet.openai.tool_parser``), tool history (``tool``
messages, an assistant's ``tool_calls``) a template that renders tools at all.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenfleet.openai.errors import UNSUPPORTED, OpenAIError
from tokenfleet.openai.structured import AUTO_REFUSED
from tokenfleet.client.served import Served
from tokenfleet.openai.tool_parser import FORMATS, ToolText, parse, without_index

PARSED = ", ".join(FORMATS)


def auto_refusal(queue: Served | None, model: str, param: str) -> OpenAIError | None:
    """Why "auto" cannot be served on ``queue`` (``param`` names the field that
    asked for it), or None when its workers' format is parsed here."""
    fmt = None if queue is None else queue.tools
    if fmt is None:  # no live worker, or one older than the field: not known
        return UNSUPPORTED.error(AUTO_REFUSED, param=param)
    if fmt == "":
        return UNSUPPORTED.error(
            f"tool_choice 'auto' needs a model that writes tool calls, but model {model!r} "
            "has a chat template without tools: send tool_choice 'required' or a named "
            "function (the output is then constrained to the function's parameters), or "
            "serve a model whose chat template takes tools", param="tool_choice")
    if fmt not in FORMATS:
        return UNSUPPORTED.error(
            f"tool_choice 'auto': model {model!r} writes tool calls in a format this gateway "
            f"does not parse (it parses {PARSED}): send tool_choice 'required' or a named "
            "function instead", param="tool_choice")
    return None


def history_refusal(queue: Served | None, model: str, messages: list[Any]) -> OpenAIError | None:
    """A 400 naming the first message of tool history, unless the queue's
    chat template renders tools."""
    if queue is not None and queue.tools not in (None, ""):
        return None
    for i, message in enumerate(messages):
        if message.role == "tool" or message.tool_calls is not None:
            field = "role" if message.role == "tool" else "tool_calls"
            return UNSUPPORTED.error(
                f"messages[{i}].{field}: tool history needs a model whose chat template "
                f"renders tools, which model {model!r} does not say it has: send the tool's "
                "result in a user message", param=f"messages[{i}].{field}")
    return None


def history_call(i: int, call: Any) -> dict[str, Any]:
    """An assistant's earlier call as the chat template renders it: its
    arguments (a JSON string in OpenAI's shape) as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(call, dict) or not isinstance(call.get("id"), str)
            or call.get("type", "function") != "function" or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str)):
        raise ValueError(f"tool_calls[{i}] must be {{\"id\": ..., \"type\": \"function\", "
                         "\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}")
    try:
        arguments = orjson.loads(fn["arguments"])
    except orjson.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON object as text")
    return {"id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


def auto_message(fmt: str, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """The assistant's message for a finished ``text`` and its finish reason:
    the calls in it as ``tool_calls``, the text around them as ``content``."""
    content, calls = parse(fmt, text)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if not calls:
        message["content"] = text
        return message, finish_reason
    message["tool_calls"] = without_index(calls)
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def auto_stream_choice(fmt: str) -> Any:
    """The ``choice`` for ``chunks``: content deltas while the text is text; a
    call held until it is complete, then sent whole as a ``tool_calls`` delta.
    Each choice of an n-choice request parses its own text."""
    parsers: dict[int, ToolText] = {}
    called: set[int] = set()

    def choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        parser = parsers.setdefault(index, ToolText(FORMATS[fmt]))
        content, calls = parser.feed(text)
        if finish_reason is not None:
            rest, more = parser.end()
            content, calls = content + rest, calls + more
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
            called.add(index)
        if finish_reason == "stop" and index in called:
            finish_reason = "tool_calls"
        return {"index": index, "delta": delta, "finish_reason": finish_reason,
                "logprobs": None}

    return choice
