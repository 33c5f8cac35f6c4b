"""vLLM's fields that shape a chat template's rendering: ``chat_template_kwargs``
(a template's own variables: how Qwen3-style templates turn thinking off),
``add_generation_prompt`` and ``continue_final_message``."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.schemas import GenerationRequest
from tokenfleet.workers.admission import Admission

from tool_templates import with_template

# Qwen3's way: a variable of the template's own, and the assistant's opening.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
            "{% if not (loop.last and continue_final_message) %}<|end|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
            "{% endif %}")
HI = [{"role": "user", "content": "hi"}]


def rendered(loaded_tiny: Any, **fields: Any) -> str:
    _, tiny = loaded_tiny
    tok = with_template(tiny, TEMPLATE)
    request = GenerationRequest(**{"messages": HI, **fields})
    return str(tok.decode(Admission(tok, Settings(), 4096).prompt_ids(request)))


def test_a_templates_own_variable_reaches_it(loaded_tiny: Any) -> None:
    assert rendered(loaded_tiny).endswith("<|user|>hi<|end|><|assistant|>")
    assert rendered(loaded_tiny, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|assistant|><think></think>")


def test_no_generation_prompt_and_a_continued_final_message(loaded_tiny: Any) -> None:
    assert rendered(loaded_tiny, add_generation_prompt=False).endswith("<|user|>hi<|end|>")
    went_on = rendered(loaded_tiny, messages=[*HI, {"role": "assistant", "content": "The"}],
                       add_generation_prompt=False, continue_final_message=True)
    assert went_on.endswith("<|assistant|>The")


@pytest.mark.parametrize(("fields", "why"), [
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "may not set chat_template"),
    ({"chat_template_kwargs": {"tokenize": False}}, "may not set tokenize"),
    ({"chat_template_kwargs": {"x": float("nan")}}, "must be JSON"),
    ({"continue_final_message": True}, "add_generation_prompt false"),
    ({"continue_final_message": True, "add_generation_prompt": False},
     "last message to be the assistant's"),
    ({"prompt": "hi", "messages": None, "add_generation_prompt": False}, "need messages"),
])
def test_fields_that_cannot_be_honoured_are_refused_saying_why(
        fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        GenerationRequest(**{"messages": HI, **fields})
