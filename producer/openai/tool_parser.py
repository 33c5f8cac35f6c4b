"""Tool calls a model writes of its own accord (``tool_choice`` "auto"), parsed
out of its text in the format its chat template declares.

Two formats of open models are parsed (``FORMATS``, by the name workers give in
their heartbeat: ``tokenfleet.workers.tool_template``):

- ``hermes`` (Hermes, Qwen2.5, Qwen3 and others): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere in the
  text, as many as the model writes; the text around them is the content.
- ``llama3_json`` (Llama 3.1 to 3.3 with JSON tools): the whole answer is one
  ``{"name": ..., "parameters": {...}}`` object (its ``<|python_tag|>`` is a
  special token, which the detokenizer drops).

A piece of text that opens a call but is not a valid one (not JSON, no name,
arguments not an object, never closed) stays text: the model wrote it, and a
client sees it as it was written rather than losing it.

The same parser serves a whole text (``parse``) and a stream (``ToolText``):
fed piece by piece, split anywhere, it gives the same content and calls.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True)
class ToolFormat:
    opening: str  # where a call starts
    closing: str | None  # where it ends; None: at the end of the text
    arguments: str  # the key of the call's arguments in its JSON
    at_start: bool = False  # a call only as the first thing of the text
    opening_is_json: bool = False  # the opening is the JSON's own first character


FORMATS = {
    "hermes": ToolFormat("<tool_call>", "</tool_call>", "arguments"),
    "llama3_json": ToolFormat("{", None, "parameters", at_start=True, opening_is_json=True),
}


def parse(format_name: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The finished ``text`` as OpenAI's message: its content (None when only
    calls and whitespace) and its ``tool_calls``."""
    parser = ToolText(FORMATS[format_name])
    content, calls = parser.feed(text)
    rest, more = parser.end()
    content += rest
    return (content if content.strip() else None), calls + more


@dataclass
class ToolText:
    """One choice's text as it streams: ``feed`` returns the text that is
    surely content and the calls completed so far. Text that may be the start
    of an opening marker, and a call until it closes, are held back."""

    format: ToolFormat
    held: str = ""  # text not given out yet
    in_call: bool = False  # ``held`` is a call's body (after its opening)
    started: bool = False  # some non-whitespace text was seen
    num_calls: int = 0
    _calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.held += text
        out: list[str] = []
        while True:
            if self.in_call:
                if self.format.closing is None:
                    break  # the call runs to the end of the text
                end = self.held.find(self.format.closing)
                if end < 0:
                    break
                body, self.held = self.held[:end], self.held[end + len(self.format.closing):]
                self.in_call = False
                self._close(body, out)
                continue
            start = self._opening_at()
            if start is None:  # held back: it may be the start of a marker
                keep = self._maybe_opening()
                out.append(self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
            out.append(self.held[:start])
            self.held = self.held[start + (0 if self.format.opening_is_json
                                           else len(self.format.opening)):]
            self.in_call = True
        content = "".join(out)
        if content.strip():
            self.started = True
        calls, self._calls = self._calls, []
        return content, calls

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest, once the text is complete: a call that runs to the end is
        parsed now; an unclosed one is text."""
        out: list[str] = []
        if self.in_call and self.format.closing is None:
            self._close(self.held, out)
        elif self.in_call:
            out.append(self.format.opening + self.held)
        else:
            out.append(self.held)
        self.held, self.in_call = "", False
        calls, self._calls = self._calls, []
        return "".join(out), calls

    def _opening_at(self) -> int | None:
        if self.format.at_start:
            if self.started or self.num_calls:
                return None
            stripped = self.held.lstrip()
            if not stripped.startswith(self.format.opening):
                if stripped:
                    self.started = True
                return None
            return len(self.held) - len(stripped)
        found = self.held.find(self.format.opening)
        return None if found < 0 else found

    def _maybe_opening(self) -> int:
        """How many characters at the end of ``held`` might begin the opening."""
        if self.format.at_start:
            return 0 if self.started or self.num_calls else len(self.held)
        for keep in range(min(len(self.format.opening) - 1, len(self.held)), 0, -1):
            if self.format.opening.startswith(self.held[-keep:]):
                return keep
        return 0

    def _close(self, body: str, out: list[str]) -> None:
        call = _call(body, self.format.arguments, self.num_calls)
        if call is None:  # not a call after all: the text as written
            opening = "" if self.format.opening_is_json else self.format.opening
            out.append(opening + body + (self.format.closing or ""))
            return
        self.num_calls += 1
        self._calls.append(call)


def _call(body: str, arguments_key: str, index: int) -> dict[str, Any] | None:
    """OpenAI's tool call (with its stream ``index``) for the JSON ``body``, or
    None when it is not one."""
    try:
        value = orjson.loads(body.strip())
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get(arguments_key, {})
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": orjson.dumps(arguments).decode()}}


def without_index(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls as a whole message carries them (the index is the stream's)."""
    return [{k: v for k, v in call.items() if k != "index"} for call in calls]
