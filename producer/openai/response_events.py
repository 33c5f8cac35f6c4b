"""A response's stream of events, made from its job's token events (no HTTP,
no Redis): the one place a response's output items are shaped.

The events are a function of the job's token log and its end: fed the same
token events (a live stream and a replay of the log give the same ones, an
attempt's repeated tokens once: ``EventCursor``), :class:`ResponseEvents` makes
the same events with the same ``sequence_number``\\ s and item ids. So a client
resumes after any sequence number, from any gateway, by replaying the log and
skipping what it saw; and a response not streamed is the final event's object.

Output items: plain text is one message item whose text streams as it comes;
a call of a fixed function (``tool_choice`` naming it) is one function call
whose arguments stream; with ``tool_choice`` "auto" the text streams until the
model opens a call, and each call goes out whole once closed (the chat route's
parser: ``tokenfleet.openai.tool_parser``); a call that names its function
(``tool_choice`` "required") goes out whole at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenfleet.openai.answer import failed, failure, finish
from tokenfleet.openai.structured import ToolCall
from tokenfleet.openai.tool_parser import FORMATS, ToolText
from tokenfleet.shared.wire.schemas import JobState, JobStatus, TokenEvent

Logprobs = Callable[[list[TokenEvent]], list[dict[str, Any]]]

# A job's end as the response's status, and the event that says it.
END_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
              "failed": "response.failed", "cancelled": "response.failed"}


def status_of(state: JobState) -> str:
    """The response's status for its job's state."""
    if state.status is JobStatus.SUCCEEDED:
        return "incomplete" if finish(state) == "length" else "completed"
    if state.status is JobStatus.CANCELLED:
        return "cancelled"
    if state.status.is_terminal:
        return "failed"
    return "in_progress" if state.status is JobStatus.RUNNING else "queued"


def usage(state: JobState) -> dict[str, Any]:
    prompt, made = state.num_prompt_tokens or 0, len(state.token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": made, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + made}


def ended(state: JobState) -> dict[str, Any]:
    """The fields of a response object that its job's end decides (but output)."""
    status = status_of(state)
    error = None
    if status == "failed":
        why = failed(state)
        error = {"code": "invalid_prompt" if why.status == 400 else "server_error",
                 "message": failure(state)}
    return {"status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "usage": usage(state), "completed_at": state.finished_at}


class ResponseEvents:
    """The events of one response, in order: :meth:`opening`, then
    :meth:`feed` for each list of token events as they come, then :meth:`close`
    with the job's end. ``items`` is the output so far, in output order."""

    def __init__(self, base: dict[str, Any], ids: str, *, call: ToolCall | None = None,
                 fmt: str | None = None, logprobs: Logprobs | None = None) -> None:
        self.base = base  # the response object as created: status, no output
        self.ids = ids  # the hex the response's item ids are made of
        self.call = call
        self.parser = None if fmt is None or call is not None else ToolText(FORMATS[fmt])
        self.logprobs = logprobs if call is None and fmt is None else None
        self.seq = -1
        self.items: list[dict[str, Any]] = []
        self.done: set[int] = set()  # output indexes whose item is done
        self.message: int | None = None  # the open message item's output index
        self.text: list[str] = []
        self.text_logprobs: list[dict[str, Any]] = []
        self.arguments: list[str] = []  # the fixed call's, as they come
        self.held: list[str] = []  # a call that names its function: held to the end
        self.space = ""  # whitespace the model's own calls may follow (tool_choice "auto")
        self.calls = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def response(self, **fields: Any) -> dict[str, Any]:
        return {**self.base, "output": [dict(item) for item in self.items], **fields}

    def opening(self) -> list[dict[str, Any]]:
        out = [self.event("response.created", response=self.response())]
        if self.base["status"] == "queued":
            out.append(self.event("response.queued", response=self.response()))
        out.append(self.event("response.in_progress",
                              response=self.response(status="in_progress")))
        return out

    def feed(self, events: list[TokenEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if self.call is not None:
                if self.call.name is None:
                    self.held.append(event.text)
                elif event.text:
                    out += self._arguments(event.text)
            elif self.parser is not None:
                content, calls = self.parser.feed(event.text)
                out += self._auto_content(content)
                for call in calls:
                    self.space = ""  # between calls, or before one: not a message
                    out += self._whole_call(call["function"]["name"],
                                            call["function"]["arguments"])
            elif event.text or self.logprobs is not None:
                values = None if self.logprobs is None else self.logprobs([event])
                out += self._content(event.text, values)
        return out

    def close(self, state: JobState) -> list[dict[str, Any]]:
        """The events from the job's end on: the open items done, then the
        response's final event (its object is the stored response)."""
        end = ended(state)
        out: list[dict[str, Any]] = []
        # An item the job left unfinished (out of tokens, failed, cancelled) is incomplete.
        status = "completed" if end["status"] == "completed" else "incomplete"
        if end["status"] in ("completed", "incomplete"):
            if self.parser is not None:
                rest, calls = self.parser.end()
                out += self._auto_content(rest)
                for call in calls:
                    self.space = ""
                    out += self._whole_call(call["function"]["name"],
                                            call["function"]["arguments"])
                if self.space and not self.calls:  # text with no call: kept whole
                    out += self._content(self.space, None)
            elif self.call is not None and self.call.name is None:
                made = self.call.calls("".join(self.held))
                if made is None:
                    out += self._content("".join(self.held), None)
                for call in made or ():
                    out += self._whole_call(call["function"]["name"],
                                            call["function"]["arguments"])
            elif self.call is not None and not self.items:
                out += self._arguments("")
            if not self.items:
                out += self._content("", None, force=True)
        for index, item in enumerate(self.items):
            if index not in self.done:
                out += self._item_done(index, status)
        return [*out, self.event(END_EVENTS[end["status"]],
                                 response=self.response(**end))]

    def replay(self, last: dict[str, Any]) -> list[dict[str, Any]]:
        """The events after :meth:`opening` of a response whose job's log is gone,
        from its last event (its final object): each item whole, and the last
        event as it was sent, its sequence number with it (so a client resuming
        after any number it saw gets the end)."""
        out: list[dict[str, Any]] = []
        for item in last["response"]["output"]:
            if item["type"] == "message":
                part = item["content"][0] if item["content"] else {}
                out += self._content(part.get("text", ""), part.get("logprobs"), force=True)
                assert self.message is not None
                out += self._item_done(self.message, item["status"])
            else:
                out += self._whole_call(item["name"], item["arguments"])
        return [*out, last]

    def _auto_content(self, text: str) -> list[dict[str, Any]]:
        """Text around the model's own calls: whitespace is held until text
        follows it (as the chat route's parser, whitespace alone between or
        around calls is no message)."""
        text, self.space = self.space + text, ""
        if text and not text.strip():
            self.space = text
            return []
        return self._content(text, None)

    def _content(self, text: str, values: list[dict[str, Any]] | None,
                 force: bool = False) -> list[dict[str, Any]]:
        if not text and not values and not force:
            return []
        out: list[dict[str, Any]] = []
        if self.message is None or self.message in self.done:
            self.message = len(self.items)
            item = {"id": f"msg_{self.ids}_{self.message}", "type": "message",
                    "status": "in_progress", "content": [], "role": "assistant"}
            self.items.append(item)
            self.text, self.text_logprobs = [], []
            out.append(self.event("response.output_item.added", output_index=self.message,
                                  item=dict(item)))
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=self.message, content_index=0,
                                  part=self._part("", None)))
        self.text.append(text)
        self.text_logprobs += values or []
        if text or values:  # an empty message (forced) has no delta
            out.append(self.event("response.output_text.delta",
                                  item_id=self.items[self.message]["id"],
                                  output_index=self.message, content_index=0, delta=text,
                                  logprobs=values or []))
        return out

    def _part(self, text: str, values: list[dict[str, Any]] | None) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.logprobs is not None:
            part["logprobs"] = values or []
        return part

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.items:
            assert self.call is not None and self.call.name is not None
            out.append(self._call_added(self.call.name))
        self.arguments.append(text)
        if text:
            out.append(self.event("response.function_call_arguments.delta",
                                  item_id=self.items[0]["id"], output_index=0, delta=text))
        return out

    def _call_added(self, name: str) -> dict[str, Any]:
        index = len(self.items)
        item = {"id": f"fc_{self.ids}_{index}", "type": "function_call", "status": "in_progress",
                "arguments": "", "call_id": f"call_{self.ids}_{self.calls}", "name": name}
        self.calls += 1
        self.items.append(item)
        return self.event("response.output_item.added", output_index=index, item=dict(item))

    def _whole_call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        if self.message is not None and self.message not in self.done:
            out = self._item_done(self.message, "completed")
        else:
            out = []
        out.append(self._call_added(name))
        index = len(self.items) - 1
        out.append(self.event("response.function_call_arguments.delta",
                              item_id=self.items[index]["id"], output_index=index,
                              delta=arguments))
        self.arguments = [arguments]
        return [*out, *self._item_done(index, "completed")]

    def _item_done(self, index: int, status: str) -> list[dict[str, Any]]:
        item = self.items[index]
        self.done.add(index)
        out: list[dict[str, Any]] = []
        if item["type"] == "message":
            text = "".join(self.text)
            part = self._part(text, self.text_logprobs)
            out.append(self.event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=text,
                                  logprobs=self.text_logprobs))
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0, part=part))
            item.update(content=[part], status=status)
        else:
            arguments = "".join(self.arguments)
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=arguments,
                                  name=item["name"]))
            item.update(arguments=arguments, status=status)
        out.append(self.event("response.output_item.done", output_index=index,
                              item=dict(item)))
        return out


def text_logprobs(shape: Callable[[list[TokenEvent]], dict[str, Any]]) -> Logprobs:
    """The Responses shape of a token's log probabilities, from the chat's."""
    def values(events: list[TokenEvent]) -> list[dict[str, Any]]:
        return [{"token": v["token"], "logprob": v["logprob"], "bytes": v["bytes"],
                 "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                                   "bytes": t["bytes"]} for t in v["top_logprobs"]]}
                for v in shape(events)["content"]]
    return values
