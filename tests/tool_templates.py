"""Chat templates that take tools, for the tests of ``tool_choice`` "auto":
a copy of the tiny model's tokenizer carries one in place of its own."""

from __future__ import annotations

import copy
from typing import Any

# A Hermes / Qwen2.5 style template, cut down to what the tests need.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Return each call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{% else %}{{ m.content }}{% endif %}"
    "{% for call in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TEMPLATE = ("{% if tools %}Respond as {\"name\": function name, \"parameters\": "
                  "dictionary}<|python_tag|>{% endif %}{% for m in messages %}{{ m.content }}"
                  "{% endfor %}")


def with_template(tokenizer: Any, template: str) -> Any:
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok
