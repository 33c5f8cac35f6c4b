"""``tool_choice`` "auto": the model's own tool calls parsed from its text in
the format its chat template declares, whole or streamed in pieces split
anywhere; the template's format read from its text; tool history rendered."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.openai.tools import auto_message, auto_stream_choice
from tokenfleet.shared.wire.schemas import GenerationRequest
from tokenfleet.shared.settings import Settings
from tokenfleet.openai.tool_parser import FORMATS, ToolText, parse
from tokenfleet.workers.admission import Admission, Rejected
from tokenfleet.workers.tool_template import tool_format

from tool_templates import HERMES_TEMPLATE, LLAMA_TEMPLATE, with_template

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
TEXT = f"Let me check.\n{CALL}\n" + CALL.replace("Oslo", "Lima")


def streamed(fmt: str, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    parser = ToolText(FORMATS[fmt])
    content, calls = "", []
    for piece in pieces:
        text, more = parser.feed(piece)
        content, calls = content + text, calls + more
    text, more = parser.end()
    return content + text, calls + more


def named(calls: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_whole_text_gives_each_call_and_the_text_around_them() -> None:
    content, calls = parse("hermes", TEXT)
    assert content == "Let me check.\n\n"
    assert named(calls) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Lima"})]
    assert [c["index"] for c in calls] == [0, 1]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse("hermes", CALL)[0] is None  # only a call: no content
    assert parse("hermes", "no tools today") == ("no tools today", [])


def test_streamed_pieces_split_anywhere_give_the_same_content_and_calls() -> None:
    whole_content, whole_calls = parse("hermes", TEXT)
    for size in (1, 2, 3, 5, 11, 40):
        pieces = [TEXT[i:i + size] for i in range(0, len(TEXT), size)]
        content, calls = streamed("hermes", pieces)
        assert content == whole_content and named(calls) == named(whole_calls), size


def test_text_that_opens_a_call_but_is_not_one_stays_text() -> None:
    for text in ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # not an object
                 "<tool_call>not json</tool_call> after",
                 '<tool_call>{"arguments": {}}</tool_call>',  # no name
                 'ends inside <tool_call>{"name": "f", "argu',  # never closed
                 "a <tool_ and no more"):
        assert parse("hermes", text) == (text, []), text
        assert streamed("hermes", list(text)) == (text, []), text


def test_a_llama_answer_that_is_one_json_call_is_a_call_and_other_text_is_text() -> None:
    text = ' {"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert named(parse("llama3_json", text)[1]) == [("get_time", {"zone": "UTC"})]
    assert named(streamed("llama3_json", list(text))[1]) == [("get_time", {"zone": "UTC"})]
    prose = 'The answer: {"name": "get_time", "parameters": {}}'
    assert parse("llama3_json", prose) == (prose, [])
    assert streamed("llama3_json", list(prose)) == (prose, [])


def test_the_response_says_tool_calls_only_when_the_model_called_one() -> None:
    message, finish = auto_message("hermes", TEXT, "stop")
    assert finish == "tool_calls" and len(message["tool_calls"]) == 2
    assert "index" not in message["tool_calls"][0]  # a message's calls carry no stream index
    message, finish = auto_message("hermes", "plain", "stop")
    assert finish == "stop" and message["content"] == "plain" and "tool_calls" not in message
    # n choices: each parses its own text; only the one that called ends "tool_calls".
    choice = auto_stream_choice("hermes")
    deltas = [choice(0, CALL[:9], None), choice(1, "just text", None), choice(0, CALL[9:], None)]
    assert deltas[0]["delta"] == {} and deltas[1]["delta"] == {"content": "just text"}
    assert deltas[2]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice(0, "", "stop")["finish_reason"] == "tool_calls"
    assert choice(1, "", "stop")["finish_reason"] == "stop"


def test_the_template_text_says_whether_it_takes_tools_and_in_which_format(
    loaded_tiny: Any
) -> None:
    _, tiny = loaded_tiny
    assert tool_format(tiny) == ""  # the built-in template takes no tools
    assert tool_format(with_template(tiny, HERMES_TEMPLATE)) == "hermes"
    assert tool_format(with_template(tiny, LLAMA_TEMPLATE)) == "llama3_json"
    assert tool_format(with_template(tiny, "{{ tools }}[TOOL_CALLS]")) == "other"


def test_a_template_written_into_a_models_tokenizer_config_is_read_when_it_loads(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    model = tmp_path / "tiny-tools"
    shutil.copytree(tiny_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": HERMES_TEMPLATE}))
    assert tool_format(AutoTokenizer.from_pretrained(model)) == "hermes"


def test_tool_history_and_definitions_are_rendered_by_a_template_that_takes_tools(
    loaded_tiny: Any
) -> None:
    _, tiny = loaded_tiny
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    request = GenerationRequest(tools=tools, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}])
    tok = with_template(tiny, HERMES_TEMPLATE)
    prompt = tok.decode(Admission(tok, Settings(), 4096).prompt_ids(request))
    assert "<tool_response>sunny, 21 C</tool_response>" in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert '"name": "get_weather", "parameters"' in prompt  # the definitions
    assert prompt.endswith("<|im_start|>assistant\n")
    with pytest.raises(Rejected, match="chat template takes no tools"):
        Admission(tiny, Settings(), 4096).prompt_ids(request)
    with pytest.raises(ValueError, match="tool message needs tool_call_id"):
        GenerationRequest(messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="tools need messages"):
        GenerationRequest(prompt="x", tools=tools)


def test_a_queue_has_one_format_only_when_every_live_worker_says_the_same() -> None:
    from tokenfleet.client.served import _one_format

    assert _one_format({"hermes"}) == "hermes"
    assert _one_format({"hermes", None}) is None  # a worker older than the field: unknown
    assert _one_format({"hermes", ""}) == ""  # one takes no tools: "auto" is refused
    assert _one_format({"hermes", "llama3_json"}) == "other"  # no one parser reads both
