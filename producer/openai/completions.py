"""OpenAI's completions request as the fleet's jobs, and their answer, with no HTTP
in it: the gateway's route (``tokenfleet.gateway.completions``) and a batch's lines
(``tokenfleet.batches.lines``) both go through :func:`completions`, which returns
the request's jobs or the ``OpenAIError`` that refuses it. What the chat request
(``tokenfleet.openai.chat``) shares with it is here too.

``model`` is the queue name. Every field of OpenAI's request, and of vLLM's, is
either honoured or refused with a 400 that names it; none is silently ignored
(docs/openai-fields.md). ``n`` fans the request out to n jobs
(``tokenfleet.client.choices``; ``best_of`` equal to n is the same, above it is
refused: ranking by likelihood is not built); ``prompt`` may be text, token ids
or a list of either (a job per prompt and choice); ``echo`` puts the prompt
before each choice's text, with its log probabilities when ``logprobs`` asks
(``tokenfleet.openai.echo``); ``suffix`` asks for insert mode, refused for a
model without fill-in-the-middle tokens. ``logprobs`` (0 to 5;
``tokenfleet.openai.logprobs``) is honoured. ``user`` is kept in the job's
metadata. ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` are
honoured as OpenAI defines them, and vLLM's sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ...) as vLLM
takes them; vLLM's others are refused by name (``tokenfleet.openai.vllm_fields``).
``response_format`` and vLLM's ``structured_outputs`` constrain the text
(``tokenfleet.openai.structured``). ``webhook_url`` (tokenfleet's, in an OpenAI
client's ``extra_body``) posts each job's end there (``tokenfleet.webhooks.delivery``).
Any other field is refused as unrecognized, as OpenAI does.

"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.client.choices import check_n
from tokenfleet.openai.answer import events, finish, shaped, usage
from tokenfleet.openai.errors import (INVALID_JSON, INVALID_VALUE, UNRECOGNIZED, UNSUPPORTED,
                                      OpenAIError)
from tokenfleet.openai.echo import echoed, prompt_wanted
from tokenfleet.openai.logprobs import MAX_COMPLETION_LOGPROBS, CompletionLogprobs, over_budget
from tokenfleet.openai.structured import StructuredRefused, requested
from tokenfleet.openai import vllm_fields
from tokenfleet.openai.token_ids import events_by_id, shaped_by_id
from tokenfleet.openai.translate import COMPLETION_PARAMS, completion_job, json_equal, route_fields
from tokenfleet.client.served import served
from tokenfleet.shared.wire.errors import NO_FIM, InvalidRequest, invalid_field, invalid_input
from tokenfleet.shared.wire.schemas import (
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    IntNotBool,
    JobState,
    TokenEvent,
)

BEST_OF = ("best_of above n is not supported: the choices are not ranked by likelihood here; "
           "ask for n choices (best_of unset or equal to n), with logprobs to rank them")
SUFFIX_IDS = ("suffix with a prompt of token ids is not supported: insert mode puts the model's "
              "sentinel tokens around the prompt's text; send the prompt as text")
# The largest token id a prompt may hold here; the worker checks its vocabulary.
MAX_TOKEN_ID = 2**31 - 1
# The most prompts one request may hold: each is a job per choice (lm-eval's
# --batch_size and LangChain's batch() send tens).
MAX_PROMPTS = 256

# Fields this gateway cannot honour, with the values that ask for nothing (any
# other is refused with a 400 naming the field), and, where leaving the field
# unset is not the whole advice, the sentence that says what to do instead.
# Every completions field is honoured now; chat has its own table.
REFUSED: dict[str, tuple[tuple[Any, ...], str | None]] = {}


def _token_ids(value: list[Any], which: str) -> list[int]:
    """``value`` as a prompt of token ids (``which``: the prompt's place in a list)."""
    if not value:
        raise ValueError(f"prompt{which} is empty")
    for i, item in enumerate(value):
        if type(item) is not int or not 0 <= item <= MAX_TOKEN_ID:
            where = f"item {i} of prompt{which}" if which else f"item {i}"
            raise ValueError(f"a prompt of token ids must hold integers from 0 to "
                             f"{MAX_TOKEN_ID}; {where} is {json.dumps(item)[:40]}")
    return value


class _Sampling(BaseModel):
    """The fields that completions and chat share."""

    model_config = ConfigDict(extra="forbid")
    ROUTE: ClassVar[str] = "completions"  # for vLLM's fields whose default is the route's

    model: str = "default"
    # The sampling fields of the same value in both (temperature, top_p, seed,
    # logit_bias, vLLM's min_tokens, ...) are added below, from the translation's
    # table (``translate.route_fields``).
    # vLLM's: log probabilities name their tokens "token_id:<id>".
    return_tokens_as_token_ids: StrictBool | None = None
    stop: str | list[str] | None = None
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
    # Which requests share a prefix: with placement on (TOKENFLEET_AFFINITY) they go
    # to the worker that holds it (shared/wire/prefixes.py).
    prompt_cache_key: str | None = Field(default=None, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _vllm_defaults(cls, data: Any) -> Any:
        """vLLM's fields this gateway does not honour, left out where they ask
        for nothing; any other value stays, to be refused naming it (``invalid``)."""
        if not isinstance(data, dict):
            return data
        return {name: value for name, value in data.items()
                if not (vllm_fields.known(cls.ROUTE, name)
                        and vllm_fields.asks_nothing(cls.ROUTE, name, value))}

    @field_validator("stream_options")
    @classmethod
    def _usage_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = set(value or {}) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise ValueError("only include_usage and continuous_usage_stats are supported, not "
                             f"{', '.join(sorted(unknown))}")
        for name, flag in (value or {}).items():
            if not isinstance(flag, bool):
                raise ValueError(f"stream_options.{name} must be true or false")
        return value

    def choices(self, settings: Any) -> int | OpenAIError:
        """How many choices (jobs) the request asks for, or the 400 that names ``n``."""
        try:
            return check_n(1 if self.n is None else self.n, settings)
        except InvalidRequest as exc:
            return INVALID_VALUE.error(str(exc), param="n")

    def named(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """The job's events as the request names their tokens (by id, if it asks)."""
        return events_by_id(events) if self.return_tokens_as_token_ids else events

    def named_shape(self, shape: Callable[[list[TokenEvent]], Any]
                    ) -> Callable[[list[TokenEvent]], Any]:
        """``shape`` naming tokens as the request asks."""
        return shaped_by_id(shape) if self.return_tokens_as_token_ids else shape

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: each chunk carries its choice's usage so far."""
        return bool((self.stream_options or {}).get("continuous_usage_stats"))


if TYPE_CHECKING:
    Sampling = _Sampling
else:
    Sampling = create_model("Sampling", __base__=_Sampling, __module__=__name__,
                            **route_fields())


class CompletionRequest(Sampling):
    # Text, or token ids; or a list of prompts, of either (a list of one is that prompt).
    prompt: str | list[Any]
    max_tokens: IntNotBool | None = 16
    best_of: IntNotBool | None = None
    echo: StrictBool | None = None
    logprobs: IntNotBool | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # vLLM's: the prompt's log probabilities with this many likeliest tokens each.
    prompt_logprobs: IntNotBool | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: str | list[Any]) -> str | list[Any]:
        """One prompt, as text or as token ids; or a list of several, all text or all
        token ids (a list of one is that prompt)."""
        if not value:
            raise ValueError("prompt is empty")
        if isinstance(value, str):
            return value
        if not all(isinstance(item, str | list) for item in value):
            return _token_ids(value, "")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"prompt holds {len(value)} prompts, above the limit of "
                             f"{MAX_PROMPTS} in one request: send several requests")
        if not (all(isinstance(item, str) for item in value)
                or all(isinstance(item, list) for item in value)):
            raise ValueError("a list of prompts must hold all text or all token ids, not both")
        for i, item in enumerate(value):
            if not item:
                raise ValueError(f"prompt {i} is empty")
        prompts = [item if isinstance(item, str) else _token_ids(item, f" {i}")
                   for i, item in enumerate(value)]
        return prompts[0] if len(prompts) == 1 else prompts

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a list."""
        several = isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)
        return list(self.prompt) if several else [self.prompt]

    def each(self) -> list[CompletionRequest]:
        """The request once per prompt, in order: the choices of prompt p are p*n to p*n+n-1."""
        prompts = self.prompts()
        if len(prompts) == 1:
            return [self]
        return [self.model_copy(update={"prompt": prompt}) for prompt in prompts]

    def refused(self, n: int, settings: Any) -> OpenAIError | None:
        """The 400 for ``best_of`` and ``echo`` where they cannot be honoured."""
        if self.best_of is not None:
            try:
                check_n(self.best_of, settings, "best_of")
            except InvalidRequest as exc:
                return INVALID_VALUE.error(str(exc), param="best_of")
            if self.best_of < n:
                return INVALID_VALUE.error(f"invalid 'best_of': {self.best_of} is less than "
                                           f"n ({n}); it must be at least n", param="best_of")
            if self.best_of > n:
                return UNSUPPORTED.error(BEST_OF, param="best_of")
        if self.suffix and not isinstance(self.prompt, str):
            return UNSUPPORTED.error(SUFFIX_IDS, param="suffix")
        return None


def invalid(exc: ValidationError, params: dict[tuple[str, ...], str] | None = None) -> OpenAIError:
    """A 400 for ``exc`` (:func:`invalid_input`); ``params`` names the fields of a
    GenerationRequest as the client knows them (else the error's location is the
    client's field)."""
    first = exc.errors(include_url=False)[0]
    kind, loc = first["type"], first["loc"]
    if kind == "extra_forbidden" and len(loc) == 1 and vllm_fields.refused(str(loc[0])):
        return UNSUPPORTED.error(vllm_fields.why(str(loc[0])), param=str(loc[0]))
    refusal = {"json_invalid": INVALID_JSON, "extra_forbidden": UNRECOGNIZED}.get(kind,
                                                                                 INVALID_VALUE)
    return refusal.error(invalid_input(exc, params), param=invalid_field(exc, params))


def refusal(ask: BaseModel, refused: dict[str, tuple[tuple[Any, ...], str | None]]
            ) -> OpenAIError | None:
    """A 400 for the first field set to something this gateway cannot honour. The
    sentence names the field and never echoes its value (it can be a long array)."""
    for name, (nothing, instead) in refused.items():
        value = getattr(ask, name)
        if not any(json_equal(value, ok) for ok in nothing):
            return UNSUPPORTED.error(instead or unsupported(name, nothing), param=name)
    return None


def unsupported(name: str, nothing: tuple[Any, ...]) -> str:
    """``name`` is not supported: leave it unset (or send one of the values that ask
    for nothing)."""
    values = [orjson.dumps(ok).decode() for ok in nothing if ok is not None]
    return (f"{name} is not supported by this gateway: leave it unset"
            + "".join(f" or {v}" for v in values))


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


async def completions(client: AsyncFleetClient, body: bytes) -> list[Completion] | OpenAIError:
    """The request in ``body`` as the fleet's jobs, one per prompt (each with its
    ``n`` choices), or the 400 (404) that refuses it."""
    try:
        ask = CompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        return invalid(exc)
    n = ask.choices(client.settings)
    if isinstance(n, OpenAIError):
        return n
    asks = ask.each()
    parts = []
    for one in asks:
        made = await _completion(client, one, n, n * len(asks))
        if isinstance(made, OpenAIError):
            return made
        parts.append(made)
    return parts


async def completion(client: AsyncFleetClient, body: bytes) -> Completion | OpenAIError:
    """The request in ``body`` as the fleet's job, or the 400 (404) that refuses
    it: the one check both the endpoint and a batch's lines go through (a line
    holds one prompt)."""
    parts = await completions(client, body)
    if isinstance(parts, OpenAIError) or len(parts) == 1:
        return parts[0] if isinstance(parts, list) else parts
    return UNSUPPORTED.error("a list of prompts is not supported in a batch line: a line's "
                             "result is one answer; send one line per prompt", param="prompt")


async def _completion(client: AsyncFleetClient, ask: CompletionRequest, n: int,
                      choices: int) -> Completion | OpenAIError:
    """One prompt's part of a request (``choices`` in all, every prompt's)."""
    refused = refusal(ask, REFUSED) or ask.refused(n, client.settings)
    if refused is not None:
        return refused
    try:
        structured, field = requested(ask)
    except StructuredRefused as exc:
        return exc.error()
    try:
        job = completion_job(ask, client.settings, structured, prompt_wanted(ask))
    except ValidationError as exc:
        return invalid(exc, {**COMPLETION_PARAMS,
                             ("structured_output",): field or "response_format"})
    if ask.logprobs is not None and not ask.stream:
        why = over_budget(choices, job.sampling.max_new_tokens, ask.logprobs + 1,
                          client.settings, "logprobs")
        if why is not None:
            return INVALID_VALUE.error(why, param="logprobs")
    if job.suffix is not None:
        queue = await served(client, job.model)
        if queue is not None and queue.fim is False:  # None: a worker that does not say
            return UNSUPPORTED.error(f"model {job.model!r} {NO_FIM}", param="suffix")
    return Completion(ask, job, n, field)


async def completion_answer(client: AsyncFleetClient, made: Completion, job_ids: list[str],
                            states: list[JobState]) -> dict[str, Any]:
    """The endpoint's answer (not streamed) for the succeeded jobs of ``made``."""
    return await shaped(client, job_ids, made.ask.logprobs is not None
                        or prompt_wanted(made.ask) is not None,
                        functools.partial(completion_body, made, job_ids, states))


async def completions_answer(client: AsyncFleetClient, parts: list[Completion],
                             job_ids: list[str], states: list[JobState]) -> dict[str, Any]:
    """The answer for a request of several prompts: each prompt's choices in turn,
    indexed on through them (prompt-major, then ``n``, as OpenAI does), and the
    usage of them all, each prompt counted once."""
    if len(parts) == 1:
        return await completion_answer(client, parts[0], job_ids, states)
    n = parts[0].n
    answers = [await completion_answer(client, part, job_ids[p * n:p * n + n],
                                       states[p * n:p * n + n])
               for p, part in enumerate(parts)]
    choices = [{**choice, "index": p * n + choice["index"]}
               for p, answer in enumerate(answers) for choice in answer["choices"]]
    return {**answers[0], "choices": choices, "usage": usage(states, n)}


def completion_body(made: Completion, job_ids: list[str], states: list[JobState],
                    logs: list[list[bytes]] | None) -> dict[str, Any]:
    """The answer for the jobs' states, and their token logs' entries when the
    request asked for log probabilities."""
    choices = [completion_choice(i, made.echo + state.text, finish(state))
               for i, state in enumerate(states)]
    for choice, log in zip(choices, logs, strict=True) if logs is not None else ():
        echoed(made.ask, choice, made.ask.named(events(log)), CompletionLogprobs)
    return {**made.head(job_ids[0]), "choices": choices, "usage": usage(states)}


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
