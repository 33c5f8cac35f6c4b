"""vLLM's request fields that this gateway does not honour, each with why.

Clients written for vLLM send its extensions through ``extra_body``; a field
OpenAI's API does not have would be refused as unrecognized, which tells the
caller nothing. These are refused by name, saying why, unless set to a value
that asks for nothing (vLLM's default), which is accepted: a client that sends
every default gets its answer. The vLLM fields the gateway honours are fields of
its request models (``tokenfleet.openai.completions``, ``tokenfleet.openai.chat``).
"""

from __future__ import annotations

from typing import Any

from tokenfleet.openai.translate import json_equal

# Field: the values that ask for nothing, and why any other is refused.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((None, False), "beam search is not built here; sample n choices "
                        "and rank them by their logprobs"),
    "length_penalty": ((None, 1, 1.0), "length_penalty goes with beam search, which is not "
                       "built here"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported: send logit_bias, "
                          "or a regex or choice in structured_outputs"),
    "bad_words": ((None, []), "bad_words is not supported: send logit_bias of -100 on "
                  "their tokens"),
    "stop_token_ids": ((None, []), "stop_token_ids is not supported: send stop strings"),
    "truncate_prompt_tokens": ((None,), "truncate_prompt_tokens is not supported: a prompt "
                               "over the queue's limit is refused, never cut"),
    "truncation_side": ((None,), "truncation_side is not supported: prompts are never cut"),
    "add_special_tokens": ((None,), "add_special_tokens is not supported: the worker adds "
                           "the model's own special tokens as its tokenizer says"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens false "
                                      "is not supported: the tokenizer's decoding stands"),
    "priority": ((None, 0), "priority (vLLM's integer one) is not supported: send "
                 "service_tier ('flex', 'priority'), or a priority on the jobs API"),
    "request_id": ((None,), "request_id is not supported: the answer's id is the fleet's "
                   "job id"),
    "cache_salt": ((None,), "cache_salt is not supported: no prompt cache is shared "
                   "between requests here"),
    "logprob_token_ids": ((None,), "logprob_token_ids is not supported: ask for logprobs "
                          "(the likeliest tokens)"),
    "return_token_ids": ((None, False), "return_token_ids is not supported: the jobs API "
                         "(GET /v1/jobs/{id}) has each job's token ids"),
    "return_token_offsets": ((None, False), "return_token_offsets is not supported"),
    "thinking_token_budget": ((None,), "thinking_token_budget is not supported: send "
                              "chat_template_kwargs to turn thinking off"),
    "repetition_detection": ((None,), "repetition_detection is not supported: send "
                             "repetition_penalty or frequency_penalty"),
    "watermarking": ((None,), "watermarking is not supported by this gateway"),
    "stream_interval": ((None, 1), "stream_interval is not supported: the workers send "
                        "tokens as they come, a few at a time under load"),
    "session_id": ((None,), "session_id is not supported: send user, or metadata"),
    "vllm_xargs": ((None,), "vllm_xargs is not supported: this fleet runs no vLLM "
                   "logits processors"),
    "kv_transfer_params": ((None,), "kv_transfer_params is not supported: disaggregated "
                           "prefill is not built here"),
    "ec_transfer_params": ((None,), "ec_transfer_params is not supported: disaggregated "
                           "encoding is not built here"),
    "routed_experts_prompt_start": ((None,), "routed_experts_prompt_start is not supported"),
    "prompt_embeds": ((None,), "prompt_embeds is not supported: send text or token ids"),
    "mm_payload": ((None,), "this gateway takes text, not multimodal input"),
    "return_mm_kwargs": ((None, False), "this gateway takes text, not multimodal "
                         "input"),
    "mm_processor_kwargs": ((None,), "this gateway takes text, not multimodal input"),
    "media_io_kwargs": ((None,), "this gateway takes text, not multimodal input"),
    "chat_template": ((None,), "chat_template is not supported: the worker renders the "
                      "model's own template (a template of the request's would be code it "
                      "runs); send chat_template_kwargs for its variables"),
    "documents": ((None,), "documents is not supported: put them in the messages"),
    "include_reasoning": ((None, True), "include_reasoning false is not supported: the "
                          "model's text is answered whole"),
    "return_prompt_text": ((None, False), "return_prompt_text is not supported"),
}
# Where a route's default differs: chat adds no special tokens, completions do.
ROUTE_NOTHING: dict[str, dict[str, tuple[Any, ...]]] = {
    "completions": {"add_special_tokens": (None, True)},
    "chat": {"add_special_tokens": (None, False), "echo": (None, False)},
}
CHAT_ONLY = {"echo": "echo is not supported on chat: the answer is the new message alone"}


def asks_nothing(route: str, name: str, value: Any) -> bool:
    """Whether ``value`` of vLLM's field ``name`` asks for nothing on ``route``."""
    nothing = ROUTE_NOTHING[route].get(name) or REFUSED[name][0]
    return any(json_equal(value, ok) for ok in nothing)


def known(route: str, name: str) -> bool:
    """Whether ``name`` is a vLLM field this table refuses on ``route``."""
    return name in REFUSED or name in ROUTE_NOTHING[route]


def refused(name: str) -> bool:
    """Whether ``name`` is a vLLM field refused here on some route."""
    return name in REFUSED or name in CHAT_ONLY


def why(name: str) -> str:
    """Why ``name`` is refused, as the 400 says it."""
    reason = REFUSED[name][1] if name in REFUSED else CHAT_ONLY[name]
    return reason if reason.startswith(name) else f"{name} is not supported: {reason}"

