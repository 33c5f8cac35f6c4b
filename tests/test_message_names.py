"""A chat message's ``name`` (OpenAI's participant name: LangChain's named
messages, a multi-agent graph's agents) reaches the chat template, which may
show it; a template that does not use it renders the chat as before."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.schemas import GenerationRequest
from tokenfleet.workers.admission import Admission

from tool_templates import with_template

# A template that shows who speaks, as multi-agent templates do.
NAMED = ("{% for m in messages %}<|{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}|>"
         "{{ m.content }}{% endfor %}<|assistant|>")
CHAT = [{"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "hello", "name": "researcher"},
        {"role": "user", "content": "and you?"}]


def test_a_template_that_shows_names_renders_each_messages_name(loaded_tiny: Any) -> None:
    _, tiny = loaded_tiny
    tok = with_template(tiny, NAMED)
    prompt = tok.decode(Admission(tok, Settings(), 4096).prompt_ids(
        GenerationRequest(messages=CHAT)))
    assert "<|user:ann|>hi<|assistant:researcher|>hello<|user|>and you?" in prompt


def test_a_template_that_does_not_use_names_renders_the_chat_as_without_them(
        loaded_tiny: Any) -> None:
    _, tiny = loaded_tiny
    admission = Admission(tiny, Settings(), 4096)
    unnamed = [{k: v for k, v in m.items() if k != "name"} for m in CHAT]
    assert (admission.prompt_ids(GenerationRequest(messages=CHAT))
            == admission.prompt_ids(GenerationRequest(messages=unnamed)))


def test_a_name_counts_towards_the_prompt_limit_and_is_never_empty() -> None:
    limits = {"settings": Settings(max_prompt_chars=10)}
    GenerationRequest.model_validate({"messages": [{"role": "user", "content": "hello"}]},
                                     context=limits)
    with pytest.raises(ValidationError, match="above this fleet's limit of 10"):
        GenerationRequest.model_validate(
            {"messages": [{"role": "user", "content": "hello", "name": "a-long-name"}]},
            context=limits)
    with pytest.raises(ValidationError, match="name"):
        GenerationRequest(messages=[{"role": "user", "content": "hi", "name": ""}])
