"""OpenAI-compatible ``POST /v1/completions`` on top of the fleet, and what the
chat endpoint (``tokenfleet.openai_chat``) shares with it.

``model`` is the queue name. Every field of OpenAI's request is either honoured
or refused with a 400 that names it; none is silently ignored. ``n`` fans the
request out to n jobs (``tokenfleet.choices``; ``best_of`` equal to n is the
same, above it is refused: ranking by likelihood is not built); ``echo`` puts
the prompt before each choice's text; ``prompt`` may be token ids; ``suffix``
asks for insert mode, refused for a model without fill-in-the-middle tokens.
``logprobs`` (0 to 5; ``tokenfleet.openai_logprobs``) is honoured (with
``echo``, refused: prompt logprobs are not computed). ``user`` is kept in the
job's metadata. ``presence_penalty``, ``frequency_penalty`` and ``logit_bias``
are honoured as OpenAI defines them, and ``top_k``, ``min_p`` and
``repetition_penalty`` as vLLM takes them. ``response_format`` and vLLM's
``structured_outputs`` constrain the text (``tokenfleet.openai_structured``).
``webhook_url`` (tokenfleet's, in an OpenAI client's ``extra_body``) posts each
job's end there (``tokenfleet.webhook_delivery``).
Any other field is refused as unrecognized, as OpenAI does.

A client that disconnects before its completion is done cancels its jobs, so
the workers' slots are freed (``tokenfleet.openai_answer``).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from tokenfleet import sse
from tokenfleet.aio import AsyncFleetClient
from tokenfleet.gateway_metrics import first_token
from tokenfleet.choices import check_n
from tokenfleet.key_limits import submit_as_caller
from tokenfleet.openai_answer import chunks, events, finish, json_answer, shaped, succeeded, usage
from tokenfleet.openai_errors import INVALID_JSON, INVALID_VALUE, UNRECOGNIZED, UNSUPPORTED
from tokenfleet.openai_logprobs import MAX_COMPLETION_LOGPROBS, CompletionLogprobs, over_budget
from tokenfleet.openai_structured import Refused, requested
from tokenfleet.served import served
from tokenfleet.shared.errors import NO_FIM, InvalidRequest, invalid_field, invalid_input
from tokenfleet.shared.schemas import FloatNotBool, GenerationRequest, IntNotBool, JobState
from tokenfleet.shared.structured import StructuredOutput

# OpenAI's names for the fields of a GenerationRequest, to name the right ``param``.
PARAMS = {("sampling", "max_new_tokens"): "max_tokens", ("sampling", "temperature"): "temperature",
          ("sampling", "top_p"): "top_p", ("sampling", "stop"): "stop",
          ("sampling", "seed"): "seed", ("sampling", "top_k"): "top_k",
          ("sampling", "repetition_penalty"): "repetition_penalty",
          ("sampling", "presence_penalty"): "presence_penalty",
          ("sampling", "frequency_penalty"): "frequency_penalty",
          ("sampling", "logit_bias"): "logit_bias", ("sampling", "min_p"): "min_p",
          ("sampling", "logprobs"): "logprobs",
          ("prompt",): "prompt", ("prompt_token_ids",): "prompt", ("model",): "model",
          ("metadata",): "user", ("webhook_url",): "webhook_url"}
BEST_OF = ("best_of above n is not supported: the choices are not ranked by likelihood here; "
           "ask for n choices (best_of unset or equal to n), with logprobs to rank them")
SUFFIX_IDS = ("suffix with a prompt of token ids is not supported: insert mode puts the model's "
              "sentinel tokens around the prompt's text; send the prompt as text")
ECHO_IDS = ("echo with a prompt of token ids is not supported: this gateway has no tokenizer to "
            "write the prompt's text; send the prompt as text, or leave echo unset")
ECHO_LOGPROBS = ("echo with logprobs is not supported: the prompt's log probabilities are not "
                 "computed; leave echo unset to get the completion's logprobs")
# The largest token id a prompt may hold here; the worker checks its vocabulary.
MAX_TOKEN_ID = 2**31 - 1

# Fields this gateway cannot honour, with the values that ask for nothing (any
# other is refused with a 400 naming the field), and, where leaving the field
# unset is not the whole advice, the sentence that says what to do instead.
# Every completions field is honoured now; chat has its own table.
REFUSED: dict[str, tuple[tuple[Any, ...], str | None]] = {}


class Sampling(BaseModel):
    """The sampling fields that completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str = "default"
    temperature: FloatNotBool | None = None
    top_p: FloatNotBool | None = None
    top_k: IntNotBool | None = None
    repetition_penalty: FloatNotBool | None = None
    presence_penalty: FloatNotBool | None = None
    frequency_penalty: FloatNotBool | None = None
    min_p: FloatNotBool | None = None
    logit_bias: dict[str, Any] | None = None  # token id (as text, in JSON): bias
    stop: str | list[str] | None = None
    seed: IntNotBool | None = None
    n: IntNotBool | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # What the text must be, and vLLM's old names for it: openai_structured.py.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # tokenfleet's own (an OpenAI client sends it in extra_body): where each
    # job's end is posted as a signed webhook (docs/webhooks.md).
    webhook_url: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _usage_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = set(value or {}) - {"include_usage"}
        if unknown:
            raise ValueError(f"only include_usage is supported, not {', '.join(sorted(unknown))}")
        return value

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        out: dict[str, Any] = {"max_new_tokens": max_tokens}
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed",
                     "presence_penalty", "frequency_penalty", "min_p", "logit_bias"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return out

    def choices(self, settings: Any) -> int | Response:
        """How many choices (jobs) the request asks for, or the 400 that names ``n``."""
        try:
            return check_n(1 if self.n is None else self.n, settings)
        except InvalidRequest as exc:
            return INVALID_VALUE.response(str(exc), param="n")

    def user_metadata(self) -> dict[str, Any]:
        return {} if self.user is None else {"user": self.user}

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(Sampling):
    prompt: str | list[Any]  # text, or token ids; a list of one of either
    max_tokens: IntNotBool | None = 16
    best_of: IntNotBool | None = None
    echo: StrictBool | None = None
    logprobs: IntNotBool | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[Any]) -> str | list[int]:
        """One prompt, as text or as token ids (a list of one of either is the same)."""
        if isinstance(value, str):
            return value
        if len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
            if isinstance(value, str):
                return value
        if not value:
            raise ValueError("prompt is empty")
        if all(isinstance(item, str | list) for item in value):
            raise ValueError("batched prompts are not supported: send one request per prompt")
        for i, item in enumerate(value):
            if type(item) is not int or not 0 <= item <= MAX_TOKEN_ID:
                raise ValueError(f"a prompt of token ids must hold integers from 0 to "
                                 f"{MAX_TOKEN_ID}; item {i} is {json.dumps(item)[:40]}")
        return value

    def generation(self, settings: Any, structured: StructuredOutput | None = None
                   ) -> GenerationRequest:
        """The fleet's request for this completion, checked against its limits."""
        prompt: dict[str, Any] = {"prompt": self.prompt} if isinstance(self.prompt, str) else {
            "prompt_token_ids": self.prompt}
        if self.suffix:  # "" asks for nothing
            prompt["suffix"] = self.suffix
        return GenerationRequest.model_validate(
            {**prompt, "model": self.model, "metadata": self.user_metadata(),
             "webhook_url": self.webhook_url,
             "sampling": {**self.sampling(16 if self.max_tokens is None else self.max_tokens),
                          **({} if self.logprobs is None else {"logprobs": self.logprobs})},
             "structured_output": structured},
            context={"settings": settings},
        )

    def refused(self, n: int, settings: Any) -> Response | None:
        """The 400 for ``best_of`` and ``echo`` where they cannot be honoured."""
        if self.best_of is not None:
            try:
                check_n(self.best_of, settings, "best_of")
            except InvalidRequest as exc:
                return INVALID_VALUE.response(str(exc), param="best_of")
            if self.best_of < n:
                return INVALID_VALUE.response(f"invalid 'best_of': {self.best_of} is less than "
                                              f"n ({n}); it must be at least n", param="best_of")
            if self.best_of > n:
                return UNSUPPORTED.response(BEST_OF, param="best_of")
        if self.echo and not isinstance(self.prompt, str):
            return UNSUPPORTED.response(ECHO_IDS, param="echo")
        if self.echo and self.logprobs is not None:
            return UNSUPPORTED.response(ECHO_LOGPROBS, param="echo")
        if self.suffix and not isinstance(self.prompt, str):
            return UNSUPPORTED.response(SUFFIX_IDS, param="suffix")
        return None


def invalid(exc: ValidationError, params: dict[tuple[str, ...], str] | None = None) -> Response:
    """A 400 for ``exc`` (:func:`invalid_input`); ``params`` names the fields of a
    GenerationRequest as the client knows them (else the error's location is the
    client's field)."""
    kind = exc.errors(include_url=False)[0]["type"]
    refusal = {"json_invalid": INVALID_JSON, "extra_forbidden": UNRECOGNIZED}.get(kind,
                                                                                 INVALID_VALUE)
    return refusal.response(invalid_input(exc, params), param=invalid_field(exc, params))


def refusal(ask: BaseModel, refused: dict[str, tuple[tuple[Any, ...], str | None]]
            ) -> Response | None:
    """A 400 for the first field set to something this gateway cannot honour. The
    sentence names the field and never echoes its value (it can be a long array)."""
    for name, (nothing, instead) in refused.items():
        value = getattr(ask, name)
        if not any(_same(value, ok) for ok in nothing):
            return UNSUPPORTED.response(instead or unsupported(name, nothing), param=name)
    return None


def unsupported(name: str, nothing: tuple[Any, ...]) -> str:
    """``name`` is not supported: leave it unset (or send one of the values that ask
    for nothing)."""
    values = [orjson.dumps(ok).decode() for ok in nothing if ok is not None]
    return (f"{name} is not supported by this gateway: leave it unset"
            + "".join(f" or {v}" for v in values))


def _same(value: Any, ok: Any) -> bool:
    # 0 == False in Python; in JSON they differ, and here too.
    if isinstance(value, bool) or isinstance(ok, bool):
        return value is ok
    return bool(value == ok)


@dataclass(frozen=True)
class Completion:
    """A completions request checked as the endpoint checks it: the job it makes,
    how many choices, and what the answer's shape depends on."""

    ask: CompletionRequest
    job: GenerationRequest
    n: int
    field: str | None = None  # the field that asked for structured output, if any

    def head(self, first_job_id: str) -> dict[str, Any]:
        return {"id": f"cmpl-{first_job_id}", "object": "text_completion",
                "created": int(time.time()), "model": self.job.model}

    @property
    def echo(self) -> str:
        return self.ask.prompt if self.ask.echo and isinstance(self.ask.prompt, str) else ""


async def completion(client: AsyncFleetClient, body: bytes) -> Completion | Response:
    """The request in ``body`` as the fleet's job, or the 400 (404) that refuses
    it: the one check both the endpoint and a batch's lines go through."""
    try:
        ask = CompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        return invalid(exc)
    n = ask.choices(client.settings)
    if isinstance(n, Response):
        return n
    refused = refusal(ask, REFUSED) or ask.refused(n, client.settings)
    if refused is not None:
        return refused
    try:
        structured, field = requested(ask)
    except Refused as exc:
        return (UNSUPPORTED if exc.unsupported else INVALID_VALUE).response(str(exc),
                                                                           param=exc.param)
    try:
        job = ask.generation(client.settings, structured)
    except ValidationError as exc:
        return invalid(exc, {**PARAMS, ("structured_output",): field or "response_format"})
    if ask.logprobs is not None and not ask.stream:
        why = over_budget(n, job.sampling.max_new_tokens, ask.logprobs + 1, client.settings,
                          "logprobs")
        if why is not None:
            return INVALID_VALUE.response(why, param="logprobs")
    if job.suffix is not None:
        queue = await served(client, job.model)
        if queue is not None and queue.fim is False:  # None: a worker that does not say
            return UNSUPPORTED.response(f"model {job.model!r} {NO_FIM}", param="suffix")
    return Completion(ask, job, n, field)


async def completion_answer(client: AsyncFleetClient, made: Completion, job_ids: list[str],
                            states: list[JobState]) -> dict[str, Any]:
    """The endpoint's answer (not streamed) for the succeeded jobs of ``made``."""
    return await shaped(client, job_ids, made.ask.logprobs is not None,
                        functools.partial(completion_body, made, job_ids, states))


def completion_body(made: Completion, job_ids: list[str], states: list[JobState],
                    logs: list[list[bytes]] | None) -> dict[str, Any]:
    """The answer for the jobs' states, and their token logs' entries when the
    request asked for log probabilities."""
    choices = [completion_choice(i, made.echo + state.text, finish(state))
               for i, state in enumerate(states)]
    for choice, log in zip(choices, logs, strict=True) if logs is not None else ():
        choice["logprobs"] = CompletionLogprobs()(events(log))
    return {**made.head(job_ids[0]), "choices": choices, "usage": usage(states)}


async def submit_constrained(request: Request, client: AsyncFleetClient, job: GenerationRequest,
                             n: int, field: str | None) -> list[str] | Response:
    """Submit the ``n`` choices of ``job`` as the request's API key allows (the
    app maps the fleet's errors to statuses); a spec that does not compile,
    checked after the key's limits, is refused naming ``field``, the request's
    own name for it."""
    try:
        return await submit_as_caller(request, client, job, n=n)
    except InvalidRequest as exc:
        if field is None or [e.get("loc") for e in exc.errors] != [["structured_output"]]:
            raise
        return INVALID_VALUE.response(f"invalid {field!r}: {exc.errors[0]['msg']}", param=field)


async def complete(client: AsyncFleetClient, body: bytes, request: Request,
                   keepalive_s: float) -> Response:
    made = await completion(client, body)
    if isinstance(made, Response):
        return made
    job_ids = await submit_constrained(request, client, made.job, made.n, made.field)
    if isinstance(job_ids, Response):
        return job_ids
    if made.ask.stream:
        echo = made.echo
        opening = completion_choice(0, echo, None) if echo else None
        shape = None if made.ask.logprobs is None else CompletionLogprobs
        return sse.response(chunks(client, job_ids, made.head(job_ids[0]), completion_choice,
                                   made.ask.include_usage, opening, logprobs=shape,
                                   on_first_token=lambda: first_token(request.scope)),
                            keepalive_s)
    states = await succeeded(client, job_ids, request)
    if isinstance(states, Response):
        return states
    return await json_answer(await completion_answer(client, made, job_ids, states),
                             heavy=made.ask.logprobs is not None)


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
