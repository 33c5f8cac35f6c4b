"""Whether a model's chat template takes tools, and the format its model
writes tool calls in, read from the template's text.

A template that renders tools mentions ``tools`` (what
``apply_chat_template(..., tools=[...])`` passes it); the call format is the
one it shows the model. The heartbeat carries the result (``tools``), so the
gateway knows, before a job is queued, whether ``tool_choice`` "auto" can be
served and how to parse the model's text (``tokenfleet.openai.tool_parser``):

- ``""``: the template takes no tools (or there is no template);
- ``hermes``: it writes ``<tool_call>...</tool_call>`` (Hermes, Qwen2.5, Qwen3);
- ``llama3_json``: it asks for ``{"name": ..., "parameters": ...}`` (Llama 3.1+);
- ``other``: it takes tools, in a format the gateway does not parse (Mistral's
  ``[TOOL_CALLS]`` is one: a special token the detokenizer drops). Tool history
  renders; "auto" is refused.
"""

from __future__ import annotations

from typing import Any

NO_TOOLS = ""
OTHER = "other"


def tool_format(tokenizer: Any) -> str:
    """The tool-call format of ``tokenizer``'s chat template (see above)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: "default", "tool_use"...
        template = "\n".join(str(t) for t in template.values())
    if not template or "tools" not in template:
        return NO_TOOLS
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters"' in template and "python_tag" in template:
        return "llama3_json"
    return OTHER


def takes_tools(fmt: str) -> bool:
    return fmt != NO_TOOLS
