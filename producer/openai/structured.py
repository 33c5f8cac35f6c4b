"""Structured output and tools at the OpenAI routes: the request fields that
constrain what the model writes, as the one spec a job carries
(``StructuredOutput``), and tool calls back in OpenAI's shape.

- ``response_format`` (both routes): ``text``, ``json_object``, ``json_schema``.
- ``structured_outputs`` (both routes), as vLLM's server takes it: one of
  ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``.
- ``tools`` with ``tool_choice`` ``"required"`` or a named function (chat): the
  output is constrained to the function's ``parameters`` (with several tools
  and ``"required"``, to ``{"name": ..., "arguments": ...}`` of one of them),
  so any model calls tools; the response carries ``tool_calls``. ``"none"``
  leaves the tools out. ``"auto"`` (the default with tools) is not constrained:
  the tools go to the chat template and the model's own calls are parsed from
  its text (``tokenfleet.openai.tools``), where its template declares a format.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from tokenfleet.openai.errors import INVALID_VALUE, UNSUPPORTED, OpenAIError
from tokenfleet.shared.wire.structured import StructuredOutput, from_response_format

# vLLM's ``structured_outputs`` fields that say what the text must be, and those
# that only tune it; every other is refused by name.
VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
VLLM_TUNING = ("disable_any_whitespace",)  # the output is compact JSON here always
KINDS = ("text", "json_object", "json_schema")  # OpenAI's response_format types
# vLLM's fields before 0.32 (which ignores them): refused, naming the new one.
LEGACY = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
AUTO_REFUSED = ("tools with tool_choice 'auto' (the default) need the tool-call format of the "
                "model's chat template, which no live worker of this queue says: send "
                "tool_choice 'required' or {\"type\": \"function\", \"function\": {\"name\": "
                "...}} (the output is then constrained to the function's parameters), or 'none'")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class StructuredRefused(ValueError):
    """A field that cannot be honoured as sent; ``param`` names it.
    ``unsupported``: what it asks for is valid OpenAI, just not served here."""

    def __init__(self, param: str, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.unsupported = unsupported

    def error(self) -> OpenAIError:
        """The 400 that names the field: unsupported, or an invalid value."""
        return (UNSUPPORTED if self.unsupported else INVALID_VALUE).error(str(self),
                                                                         param=self.param)


def requested(ask: Any) -> tuple[StructuredOutput | None, str | None]:
    """The spec ``ask.response_format`` or ``ask.structured_outputs`` ask for,
    and the field it came from (to name it in errors); ``Refused`` for a wrong
    one, or for vLLM's removed ``guided_*`` fields."""
    for name in LEGACY:
        if getattr(ask, name) is not None:
            raise StructuredRefused(name, f"{name} is not supported: vLLM 0.32 removed it too; send "
                                    f"structured_outputs {{\"{name.removeprefix('guided_')}\": ...}}",
                                    unsupported=True)
    response_format, structured_outputs = ask.response_format, ask.structured_outputs
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    try:
        spec = from_response_format(response_format)
    except ValueError as exc:
        raise StructuredRefused("response_format", str(exc),
                                unsupported=isinstance(kind, str) and kind not in KINDS) from exc
    vllm = _vllm(structured_outputs)
    if spec is not None and vllm is not None:
        raise StructuredRefused("structured_outputs", "give response_format or structured_outputs, "
                                "not both: each constrains the whole output")
    if vllm is not None:
        return vllm, "structured_outputs"
    return spec, None if spec is None else "response_format"


def _vllm(value: Any) -> StructuredOutput | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise StructuredRefused("structured_outputs", "structured_outputs must be an object with one of "
                                + ", ".join(VLLM_KINDS))
    unknown = set(value) - set(VLLM_KINDS) - set(VLLM_TUNING)
    if unknown:
        raise StructuredRefused("structured_outputs", f"structured_outputs.{sorted(unknown)[0]} is not "
                                f"supported by this gateway: give one of {', '.join(VLLM_KINDS)}",
                                unsupported=True)
    given = [k for k in VLLM_KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise StructuredRefused("structured_outputs", "structured_outputs takes exactly one of "
                                f"{', '.join(VLLM_KINDS)}, not {len(given)}")
    kind, spec = given[0], value[given[0]]
    try:
        if kind == "json_object":
            return StructuredOutput(kind="json_object")
        if kind == "json":
            schema = orjson.loads(spec) if isinstance(spec, str) else spec
            return StructuredOutput(kind="json_schema", json_schema=schema)
        return StructuredOutput.model_validate({"kind": kind, kind: spec})
    except ValueError as exc:  # pydantic's and orjson's errors are ValueErrors
        raise StructuredRefused("structured_outputs", f"structured_outputs.{kind}: "
                                f"{_one_line(exc)}") from exc


@dataclass(frozen=True)
class ToolCall:
    """How one chat's output becomes a tool call: ``name`` when the function is
    fixed (the text is its arguments), else None (the text is
    ``{"name": ..., "arguments": ...}``)."""

    name: str | None
    spec: StructuredOutput

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """OpenAI's ``tool_calls`` for the finished text; None when the text is
        not a whole call (the job ran out of tokens)."""
        if self.name is not None:
            return [_call(self.name, text)]
        try:
            chosen = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None
        return [_call(chosen["name"], orjson.dumps(chosen["arguments"]).decode())]

    def opening(self) -> dict[str, Any]:
        """The stream's first chunk: the call's id and name, when fixed."""
        delta: dict[str, Any] = {"role": "assistant", "content": None}
        if self.name is not None:
            delta["tool_calls"] = [{"index": 0, **_call(self.name, "")}]
        return {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}

    def stream_choice(self) -> Any:
        """The ``choice`` for ``chunks``: argument text as deltas of the fixed
        call as it comes; for a call that names its function, the whole call
        once the text is complete (the name is in it). Each choice of an
        n-choice request holds its own text."""
        held: dict[int, list[str]] = {}

        def choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
            delta: dict[str, Any] = {}
            if self.name is not None and text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            elif self.name is None:
                own = held.setdefault(index, [])
                own.append(text)
                calls = self.calls("".join(own)) if finish_reason is not None else None
                if calls:
                    delta = {"tool_calls": [{"index": 0, **calls[0]}]}
            if finish_reason == "stop":
                finish_reason = "tool_calls"
            return {"index": index, "delta": delta, "finish_reason": finish_reason,
                    "logprobs": None}

        return choice


def asks_auto(tools: Any, tool_choice: Any) -> bool:
    """Whether the model is to call the tools of its own accord ("auto", the
    default when tools are given)."""
    return tools not in (None, []) and tool_choice in (None, "auto")


def tool_call(tools: Any, tool_choice: Any) -> ToolCall | None:
    """The constrained call ``tools`` and ``tool_choice`` ask for, or None when
    the output is not constrained (no tools, ``tool_choice`` "none" or "auto");
    ``Refused`` naming the field otherwise."""
    if tools in (None, []):
        if tool_choice not in (None, "none"):
            raise StructuredRefused("tool_choice", "tool_choice needs tools: give tools, or leave "
                                    "tool_choice unset")
        return None
    functions = _functions(tools)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):  # unset with tools is "auto": the model's own calls
        return None
    if tool_choice == "required":
        if len(functions) == 1:
            name, parameters = next(iter(functions.items()))
            return ToolCall(name, _schema(name, parameters))
        return ToolCall(None, StructuredOutput(kind="json_schema", name="tool call", json_schema={
            "anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                        "arguments": parameters},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name, parameters in functions.items()]}))
    name = _named(tool_choice)
    if name not in functions:
        raise StructuredRefused("tool_choice", f"tool_choice names function {name[:64]!r}, which is "
                                f"not among the tools ({', '.join(sorted(functions))})")
    return ToolCall(name, _schema(name, functions[name]))


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """Each function's name and parameters schema."""
    if not isinstance(tools, list):
        raise StructuredRefused("tools", "tools must be a list of {\"type\": \"function\", \"function\": "
                                "{...}}")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                fn, dict):
            raise StructuredRefused("tools", f"tools[{i}] must be {{\"type\": \"function\", "
                                    "\"function\": {...}}: only function tools are supported")
        name, parameters = fn.get("name"), fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(name, str) or not name:
            raise StructuredRefused("tools", f"tools[{i}].function.name must be a non-empty string")
        if not isinstance(parameters, dict):
            raise StructuredRefused("tools", f"tools[{i}].function.parameters must be a JSON schema "
                                    "object")
        if name in functions:
            raise StructuredRefused("tools", f"tools[{i}]: function {name[:64]!r} is given twice")
        functions[name] = parameters
    return functions


def _named(tool_choice: Any) -> str:
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function"
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
        raise StructuredRefused("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    return str(fn["name"])


def _schema(name: str, parameters: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(kind="json_schema", name=f"parameters of {name}",
                            json_schema=parameters)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _one_line(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors(include_url=False)[0]
        return str(first["msg"]).removeprefix("Value error, ")
    return str(exc)
