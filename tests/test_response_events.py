"""A response's events and output items (``ResponseEvents``) and its conversation
(``tokenfleet.openai.responses.messages``), with no Redis: what the stream says for
a text, for a model's own calls, for a call cut short, and the same events at
every replay."""

from __future__ import annotations

from typing import Any

from tokenfleet.openai.response_events import ResponseEvents
from tokenfleet.openai.responses import messages, output_messages
from tokenfleet.shared.wire.schemas import FinishReason, JobState, JobStatus, TokenEvent

BASE = {"id": "resp_0", "object": "response", "status": "in_progress", "output": []}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def token_events(*texts: str) -> list[TokenEvent]:
    return [TokenEvent(index=i, token_ids=[i], text=text) for i, text in enumerate(texts)]


def ended(text: str, reason: FinishReason = FinishReason.EOS) -> JobState:
    return JobState(id="q:0", status=JobStatus.SUCCEEDED, text=text, finish_reason=reason,
                    token_ids=list(range(5)), num_prompt_tokens=3)


def run(*texts: str, fmt: str | None = None, reason: FinishReason = FinishReason.EOS
        ) -> list[dict[str, Any]]:
    writer = ResponseEvents(BASE, "0", fmt=fmt)
    out = writer.opening() + writer.feed(token_events(*texts))
    return out + writer.close(ended("".join(texts), reason))


def test_a_text_streams_as_one_message_and_ends_completed() -> None:
    events = run("Hel", "lo", "")
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["output_tokens"] == 5
    # Every replay of the same token events makes the same events.
    assert run("Hel", "lo", "") == events


def test_out_of_tokens_is_incomplete_with_its_reason() -> None:
    final = run("Hel", reason=FinishReason.LENGTH)[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_whitespace_between_the_models_own_calls_is_no_message() -> None:
    events = run(CALL, "\n", CALL, fmt="hermes")
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call"]
    assert len({item["call_id"] for item in output}) == 2
    # The items done in the stream are the response's.
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == output


def test_text_then_a_call_is_a_message_then_a_function_call() -> None:
    output = run("Let me check.", "\n", CALL, fmt="hermes")[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "Let me check."
    # As the next turn's history: one assistant message with the text and the call.
    history = output_messages(output)
    assert len(history) == 1 and history[0]["role"] == "assistant"
    assert history[0]["content"] == [{"type": "text", "text": "Let me check."}]
    assert [c["function"]["name"] for c in history[0]["tool_calls"]] == ["get_weather"]


def test_a_call_cut_short_is_not_part_of_the_conversation() -> None:
    cut = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": ',
           "status": "incomplete"}
    assert output_messages([cut]) == []


def test_function_call_outputs_are_tool_messages_after_their_calls() -> None:
    history = messages([
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]}])
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in history[1]["tool_calls"]] == ["c1", "c2"]
    assert history[3]["content"] == [{"type": "text", "text": "rain"}]


def test_a_replay_from_the_final_object_ends_with_the_last_event_as_sent() -> None:
    events = run("Hel", "lo")
    writer = ResponseEvents(BASE, "0")
    replayed = writer.opening() + writer.replay(events[-1])
    assert replayed[-1] == events[-1]
    assert "".join(e["delta"] for e in replayed if e["type"] == "response.output_text.delta") \
        == "Hello"
