"""The one mapping between OpenAI's requests and the fleet's ``GenerationRequest``,
both ways: :func:`completion_job` and :func:`chat_job` make the fleet's request of a
checked completions or chat request (``tokenfleet.openai.completions``,
``tokenfleet.openai.chat``), and :func:`to_body` makes the OpenAI body of a fleet
request (a batch line written as the request itself). A refusal names a field by
the same tables (:data:`COMPLETION_PARAMS`, :data:`CHAT_PARAMS`): a new sampling
field is one row of :data:`SAMPLING_NAMES`.
"""

from __future__ import annotations

from typing import Annotated, Any

import annotated_types

from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.wire.schemas import GenerationRequest, SamplingParams
from tokenfleet.shared.wire.structured import StructuredOutput

# SamplingParams' field: the OpenAI body's field (vLLM's for the extra ones).
SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
    "top_k": "top_k", "seed": "seed", "stop": "stop", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias",
    "logprobs": "logprobs", "min_tokens": "min_tokens",
    "ignore_eos": "ignore_eos", "include_stop_str_in_output": "include_stop_str_in_output",
    "skip_special_tokens": "skip_special_tokens"}
# Those whose value is the same in both (the others are reshaped: max_tokens has
# a per-route default, stop may be one string, logprobs is a flag plus
# top_logprobs on chat, logit_bias is keyed by text in JSON).
SAME_VALUE = tuple(name for name in SAMPLING_NAMES
                   if name not in ("max_new_tokens", "stop", "logprobs"))
BODY_SAMPLING = {name: openai for name, openai in SAMPLING_NAMES.items()
                 if name not in ("logit_bias", "logprobs")}  # reshaped in to_body
# GenerationRequest's fields that shape the chat template's rendering (vLLM's
# names, the chat body's too).
TEMPLATE_FIELDS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")
# OpenAI's service tiers as the fleet's priority levels, and the tier an answer
# says it used: flex is the batch level (it fills the slots live jobs leave, and
# is preempted by them), priority the high level (an API key may forbid it).
SERVICE_TIERS = {"auto": ("normal", "default"), "default": ("normal", "default"),
                 "flex": ("batch", "flex"), "priority": ("high", "priority")}
# OpenAI's names for the fields of a GenerationRequest, to name the right ``param``.
COMPLETION_PARAMS: dict[tuple[str, ...], str] = {
    **{("sampling", name): openai for name, openai in SAMPLING_NAMES.items()},
    ("prompt",): "prompt", ("prompt_token_ids",): "prompt", ("model",): "model",
    ("metadata",): "user", ("webhook_url",): "webhook_url"}
CHAT_PARAMS: dict[tuple[str, ...], str] = {
    **COMPLETION_PARAMS, **{(name,): name for name in TEMPLATE_FIELDS},
    ("messages",): "messages", ("sampling", "logprobs"): "top_logprobs",
    ("sampling", "max_new_tokens"): "max_completion_tokens", ("metadata",): "metadata"}


# The constraints a field's value is checked against once, by SamplingParams.
BOUNDS = (annotated_types.Gt, annotated_types.Ge, annotated_types.Lt, annotated_types.Le,
          annotated_types.MultipleOf, annotated_types.MinLen, annotated_types.MaxLen)


def route_fields() -> dict[str, Any]:
    """The request models' fields for :data:`SAME_VALUE`: each by its OpenAI (or
    vLLM) name, optional, of ``SamplingParams``' own type. Its bounds are left to
    the fleet's request, which checks them once and names the field by
    :data:`COMPLETION_PARAMS`: a new sampling field is a row of
    :data:`SAMPLING_NAMES`, not a line in the models."""
    out: dict[str, Any] = {}
    for name in SAME_VALUE:
        info = SamplingParams.model_fields[name]
        checks = [m for m in info.metadata if not isinstance(m, BOUNDS)]
        kind: Any = Annotated[(info.annotation, *checks)] if checks else info.annotation
        out[SAMPLING_NAMES[name]] = (kind | None, None)
    return out


def json_equal(value: Any, other: Any) -> bool:
    """Whether two values read from JSON are the same JSON: 0 == False in Python;
    in JSON they differ, and in a request's fields too."""
    if isinstance(value, bool) or isinstance(other, bool):
        return value is other
    return bool(value == other)


def sampling(ask: Any, max_tokens: int) -> dict[str, Any]:
    """The sampling fields both routes share, as ``SamplingParams``' (``ask``: a
    checked completions or chat request)."""
    out: dict[str, Any] = {"max_new_tokens": max_tokens}
    for name in SAME_VALUE:
        if getattr(ask, SAMPLING_NAMES[name]) is not None:
            out[name] = getattr(ask, SAMPLING_NAMES[name])
    if ask.stop is not None:
        out["stop"] = [ask.stop] if isinstance(ask.stop, str) else ask.stop
    return out


def completion_job(ask: Any, settings: Any, structured: StructuredOutput | None = None,
                   prompt_logprobs: int | None = None) -> GenerationRequest:
    """The fleet's request for a completions request of one prompt, checked
    against the fleet's limits (``settings``)."""
    prompt: dict[str, Any] = {"prompt": ask.prompt} if isinstance(ask.prompt, str) else {
        "prompt_token_ids": ask.prompt}
    if ask.suffix:  # "" asks for nothing
        prompt["suffix"] = ask.suffix
    return GenerationRequest.model_validate(
        {**prompt, "model": ask.model,
         "metadata": {} if ask.user is None else {"user": ask.user},
         "webhook_url": ask.webhook_url, "prompt_cache_key": ask.prompt_cache_key or None,
         "sampling": {**sampling(ask, 16 if ask.max_tokens is None else ask.max_tokens),
                      **({} if ask.logprobs is None else {"logprobs": ask.logprobs}),
                      **({} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs})},
         "structured_output": structured},
        context={"settings": settings},
    )


def chat_job(ask: Any, settings: Any, structured: StructuredOutput | None = None,
             tools: Any = None) -> GenerationRequest:
    """The fleet's request for a chat request; without a length, as long as the
    fleet allows. ``tools`` go to the chat template (only "auto" shows them: a
    constrained call writes bare arguments, not the model's own call format)."""
    limit = next(n for n in (ask.max_completion_tokens, ask.max_tokens,
                             settings.max_new_tokens_limit) if n is not None)
    named = {"user": ask.user, "safety_identifier": ask.safety_identifier}
    metadata = {**(ask.metadata or {}), **{k: v for k, v in named.items() if v is not None}}
    out = sampling(ask, limit)
    if ask.logprobs:
        out["logprobs"] = ask.top_logprobs or 0
    return GenerationRequest.model_validate(
        {"messages": [message(m) for m in ask.messages], "model": ask.model,
         "priority": tier(ask.service_tier)[0], **template_fields(ask),
         "metadata": metadata, "sampling": out, "webhook_url": ask.webhook_url,
         "structured_output": structured, "tools": tools,
         "prompt_cache_key": ask.prompt_cache_key or None},
        context={"settings": settings},
    )


def message(m: Any) -> dict[str, Any]:
    """A chat message as the fleet's: text parts joined, developer as system."""
    text = (m.content if isinstance(m.content, str)
            else "\n".join(part["text"] for part in m.content or []))
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": text}
    if m.tool_calls is not None:
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name:  # "" names no one
        out["name"] = m.name
    return out


def template_fields(ask: Any) -> dict[str, Any]:
    """vLLM's template fields as given; continuing the last message opens no new
    one unless the request says otherwise."""
    fields = {name: getattr(ask, name) for name in TEMPLATE_FIELDS
              if getattr(ask, name) is not None}
    if ask.continue_final_message:
        fields.setdefault("add_generation_prompt", False)
    return fields


def tier(service_tier: str | None) -> tuple[str, str]:
    """The fleet's priority level for a ``service_tier``, and the tier the answer
    says it used."""
    return SERVICE_TIERS.get(service_tier or "auto", SERVICE_TIERS["auto"])


def to_body(request: GenerationRequest) -> dict[str, Any]:
    """A ``GenerationRequest`` as the OpenAI request its endpoint takes (a batch
    line's, written as the request itself): every field the endpoint maps back to
    the same request. ``InvalidRequest`` names a field the endpoint's body cannot
    carry, rather than leave it out; the batch sets ``priority``, ``tenant``,
    ``idempotency_key`` and the deadline (its window) of each line itself."""
    chat = request.messages is not None
    body: dict[str, Any] = {"model": request.model}
    if chat:
        body["messages"] = [m if isinstance(m, dict) else m.model_dump(exclude_none=True)
                            for m in request.messages or ()]
    elif request.prompt_token_ids is not None:
        body["prompt"] = list(request.prompt_token_ids)
    else:
        body["prompt"] = request.prompt
    if request.suffix is not None:
        body["suffix"] = request.suffix
    sampling = request.sampling.model_dump(exclude_defaults=True)
    sampling["max_new_tokens"] = request.sampling.max_new_tokens
    for name, value in sampling.items():
        if name in BODY_SAMPLING and value is not None:
            body[BODY_SAMPLING[name]] = value
    if request.sampling.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in request.sampling.logit_bias.items()}
    logprobs = request.sampling.logprobs
    if logprobs is not None:
        body.update({"logprobs": True, "top_logprobs": logprobs} if chat
                    else {"logprobs": logprobs})
    if request.sampling.prompt_logprobs is not None:
        if chat:
            raise InvalidRequest("sampling.prompt_logprobs: a chat line cannot carry it "
                                 "(the chat endpoint refuses it); send a prompt instead")
        body["prompt_logprobs"] = request.sampling.prompt_logprobs
    if request.sampling.choice_index:
        raise InvalidRequest("sampling.choice_index: a batch line is one choice, the first; "
                             "send its seed for another draw")
    if request.response_id is not None:
        raise InvalidRequest("response_id: a batch line is no stored response (POST "
                             "/v1/responses makes those); leave it unset")
    if chat:
        body.update(request.model_dump(include=set(TEMPLATE_FIELDS), exclude_defaults=True))
    body.update(_metadata(request.metadata, chat))
    if request.webhook_url is not None:
        body["webhook_url"] = request.webhook_url
    if request.prompt_cache_key is not None:
        body["prompt_cache_key"] = request.prompt_cache_key
    if request.structured_output is not None:
        body.update(_structured(request.structured_output))
    if request.tools is not None:  # a request with tools is a chat
        body["tools"] = request.tools
    return body


def _metadata(metadata: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request's metadata as the endpoint's fields: ``user`` on both; the
    rest in a chat's ``metadata`` (OpenAI's, strings only)."""
    user = metadata.get("user")
    rest = {k: v for k, v in metadata.items() if k != "user"}
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("metadata: 'user' must be a string (OpenAI's user)")
    if rest and not (chat and all(isinstance(v, str) for v in rest.values())):
        where = "a chat carries metadata of strings only" if chat else (
            "a completion carries only metadata['user'] (OpenAI's user)")
        raise InvalidRequest(f"metadata: {where}; got {', '.join(sorted(rest))[:200]}")
    out: dict[str, Any] = {} if user is None else {"user": user}
    return {**out, "metadata": rest} if rest else out


def _structured(spec: StructuredOutput) -> dict[str, Any]:
    """A spec as the field the endpoints read it from: OpenAI's
    ``response_format`` for JSON (a schema keeps its name), vLLM's
    ``structured_outputs`` for the rest."""
    if spec.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if spec.kind == "json_schema":
        named = {} if spec.name is None else {"name": spec.name}
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {**named, "schema": spec.json_schema}}}
    return {"structured_outputs": {spec.kind: getattr(spec, spec.kind)}}
