"""Wire types: everything that crosses Redis is one of these, as JSON.

Limits that depend on deployment (prompt size, max_new_tokens, payload size)
come from :class:`tokenfleet.shared.settings.Settings`; pass ``context={"settings": s}`` to
``model_validate`` to check against other limits than the process-wide ones.
"""

from __future__ import annotations

import enum
import hashlib
import math
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tokenfleet.shared.wire.keys import QUEUE_NAME_RULE, TENANT_NAME_RULE, is_queue_name, is_tenant_name
from tokenfleet.shared.settings import Settings, get_settings
from tokenfleet.shared.wire.structured import StructuredOutput
from tokenfleet.shared.webhook_outbox import webhook_url_problem

# How deep metadata may nest (orjson itself stops at 255; a bound here keeps the
# check cheap and the message clear).
MAX_METADATA_DEPTH = 32
# The longest idempotency key.
MAX_IDEMPOTENCY_KEY = 128
# How many tokens one request may bias (OpenAI's own bound is of this order).
MAX_LOGIT_BIAS = 300
# The most alternatives a token's log probabilities may list (OpenAI's chat bound).
MAX_TOP_LOGPROBS = 20


def _not_bool(kind: str) -> BeforeValidator:
    # JSON's true is not 1, yet pydantic takes it as 1 for an int or a float.
    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"must be {kind}, not {str(value).lower()}")
        return value
    return BeforeValidator(check)


# The numbers a request gives: what pydantic takes for one, less true and false.
IntNotBool = Annotated[int, _not_bool("an integer")]
FloatNotBool = Annotated[float, _not_bool("a number")]


def _limits(info: ValidationInfo) -> Settings:
    context = info.context if isinstance(info.context, dict) else {}
    settings = context.get("settings")
    return settings if isinstance(settings, Settings) else get_settings()


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class SamplingParams(_Wire):
    """How one job samples; every job in a batch keeps its own."""

    max_new_tokens: IntNotBool = Field(default=64, ge=1)
    # vLLM's: no end (EOS or a stop token id) before this many tokens are made.
    min_tokens: IntNotBool = Field(default=0, ge=0)
    # vLLM's: an end-of-sequence token does not end the job (benchmarks fix the
    # output length with it); stop strings and max_new_tokens still do.
    ignore_eos: StrictBool = False
    # vLLM's: a matched stop string stays at the end of the text; special tokens
    # (the model's markers) are written into the text.
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    temperature: FloatNotBool = Field(default=1.0, ge=0.0, le=100.0, description="0 is greedy")
    top_p: FloatNotBool = Field(default=1.0, gt=0.0, le=1.0)
    top_k: IntNotBool = Field(default=0, ge=0, description="0 keeps every token")
    seed: IntNotBool | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list)
    repetition_penalty: FloatNotBool = Field(default=1.0, gt=0.0, le=10.0)
    # OpenAI's penalties, on the counts of the tokens generated so far.
    presence_penalty: FloatNotBool = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: FloatNotBool = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[IntNotBool, FloatNotBool] = Field(
        default_factory=dict, description="token id: a bias from -100 to 100 added to its logit")
    min_p: FloatNotBool = Field(default=0.0, ge=0.0, le=1.0,
                         description="drop tokens below min_p times the likeliest one's probability")
    logprobs: IntNotBool | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS,
        description="report each token's log probability and this many likeliest alternatives")
    prompt_logprobs: IntNotBool | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS,
        description="report each prompt token's log probability (the first has none) and this "
                    "many likeliest alternatives at its position, from the prefill's logits")
    # Which choice of an n-choice request this job is: with a seed, choice i
    # draws with choice_seed(seed, i), so it is the same as the single request
    # with that seed and choice_index (choice 0 is the plain seeded request).
    choice_index: IntNotBool = Field(default=0, ge=0, lt=2**31)

    @property
    def draw_seed(self) -> int | None:
        """The seed this job's draws use (:func:`choice_seed`), None when unseeded."""
        return None if self.seed is None else choice_seed(self.seed, self.choice_index)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_bounded(cls, value: dict[int, float]) -> dict[int, float]:
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(value)} entries, at most {MAX_LOGIT_BIAS} "
                             "are allowed")
        for token_id, bias in value.items():
            if token_id < 0:
                raise ValueError(f"logit_bias token id {token_id} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias for token {token_id} is {bias}, outside -100 to 100")
        return value

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new_tokens_within_limit(cls, value: int, info: ValidationInfo) -> int:
        limit = _limits(info).max_new_tokens_limit
        if value > limit:
            raise ValueError(
                f"max_new_tokens is {value}, above this fleet's limit of {limit} "
                "(TOKENFLEET_MAX_NEW_TOKENS_LIMIT)"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings_bounded(cls, value: list[str], info: ValidationInfo) -> list[str]:
        limit = _limits(info).max_stop_strings
        if len(value) > limit:
            raise ValueError(f"{len(value)} stop strings given, at most {limit} are allowed")
        for s in value:
            if not s or len(s) > 128:
                raise ValueError("each stop string must be 1 to 128 characters long")
        return value


def choice_seed(seed: int, choice_index: int) -> int:
    """The seed of choice ``choice_index`` of a request seeded ``seed``: the seed
    itself for choice 0, else a hash of both (below 2**63, as a seed must be), so
    the choices of one request draw independently of each other and of the
    requests seeded ``seed + 1``, ``seed + 2``..."""
    if choice_index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:choice:{choice_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ToolFunctionCall(_Wire):
    name: str = Field(min_length=1)
    arguments: dict[str, Any]  # an object, as chat templates render it


class ToolCallMessage(_Wire):
    """A call an assistant made earlier in the conversation (tool history)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolFunctionCall


class ChatMessage(_Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    # Who speaks (OpenAI's participant name: LangChain's named messages, a
    # multi-agent graph's agents), passed to the chat template, which may show it.
    name: str | None = Field(default=None, min_length=1)
    # Tool history, for a chat template that takes tools (its worker refuses it
    # otherwise): an assistant's calls, and the result a tool message answers.
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages only")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    @property
    def is_tool_history(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)


Priority = Literal["high", "normal", "low", "batch"]
# The arguments of ``apply_chat_template`` that decide how it renders, not what
# the template sees: never a request's (a template of its own is code).
RENDER_ARGUMENTS = frozenset({
    "chat_template", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
    "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask", "tools", "documents",
    "conversation", "messages", "add_generation_prompt", "continue_final_message",
    "processor_kwargs"})
# A token id as a request gives it: a JSON integer, never a float or a boolean.
TokenId = Annotated[int, Strict(), Field(ge=0, lt=2**31)]


class GenerationRequest(_Wire):
    """One text-generation job as a producer asks for it."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # A prompt given as token ids of the queue's model, used as they are (not
    # tokenized again); the worker checks each against its vocabulary.
    prompt_token_ids: list[TokenId] | None = None
    # Insert mode: the text after the one asked for, for a model trained to fill
    # in the middle (its worker refuses it otherwise); with a text prompt only.
    suffix: str | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    model: str = "default"
    priority: Priority = "normal"
    deadline_s: FloatNotBool | None = Field(default=None, gt=0.0,
                                            description="seconds from submit")
    idempotency_key: str | None = Field(default=None, min_length=1,
                                        max_length=MAX_IDEMPOTENCY_KEY)
    metadata: dict[str, Any] = Field(default_factory=dict)
    # Whose job it is: a trusted backend passes it, the gateway takes it from the
    # API key. The fleet shares its slots fairly among tenants with queued work
    # (docs/how-it-works.md). None: the tenant "default".
    tenant: str | None = None
    # Its shape is checked here; whether it compiles, at submit within a budget
    # (shared/grammar_check.py): a compile can take seconds, a validator must not.
    structured_output: StructuredOutput | None = Field(
        default=None, description="what the text must be (a JSON schema, a regex, ...)")
    # OpenAI's tools (``{"type": "function", "function": {...}}``), rendered by
    # the chat template so the model may call them (``tool_choice`` "auto").
    tools: list[dict[str, Any]] | None = None
    # How the chat template renders ``messages`` (vLLM's fields): variables of the
    # template's own (``enable_thinking``, ...), the assistant's opening after the
    # last message, or the last (assistant's) message left open to go on from.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # Where the job's end (job.completed, job.failed, ...) is posted, signed as
    # Standard Webhooks (docs/webhooks.md).
    webhook_url: str | None = None
    # The stored response this job is (POST /v1/responses): its webhook events
    # are then OpenAI's response.* naming the response (job_webhook.lua).
    response_id: str | None = Field(default=None, pattern=r"^resp_[0-9a-f]{32}$")
    # OpenAI's hint of which requests share a prefix: a prefix key of its own
    # with placement on (shared/wire/prefixes.py).
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=1024)

    @field_validator("model")
    @classmethod
    def _queue_name(cls, value: str) -> str:
        if not is_queue_name(value):
            raise ValueError(f"model (the queue name) must be {QUEUE_NAME_RULE}, got {value!r}")
        return value

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, value: str | None) -> str | None:
        if value is not None and not is_tenant_name(value):
            raise ValueError(f"tenant must be {TENANT_NAME_RULE}, got {value[:80]!r}")
        return value

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, value: str | None) -> str | None:
        problem = None if value is None else webhook_url_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_is_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        problem = json_problem(value, "metadata")
        if problem:
            raise ValueError(
                f"{problem}; metadata must be JSON: objects with string keys, arrays, "
                "strings, finite numbers, true, false, null"
            )
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        problem = json_problem(value, "chat_template_kwargs")
        if problem:
            raise ValueError(f"{problem}; chat_template_kwargs must be JSON")
        taken = sorted(set(value) & RENDER_ARGUMENTS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the fleet "
                             "sets how a template is rendered (send add_generation_prompt or "
                             "continue_final_message as fields of their own)")
        return value

    @field_validator("tools")
    @classmethod
    def _tools_are_json(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        problem = None if value is None else json_problem(value, "tools")
        if problem:
            raise ValueError(f"{problem}; tools must be JSON, as OpenAI's function tools are")
        return value

    @model_validator(mode="after")
    def _one_input_within_limits(self, info: ValidationInfo) -> GenerationRequest:
        limits = _limits(info)
        given = [self.prompt, self.messages, self.prompt_token_ids]
        if sum(x is not None for x in given) != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.suffix is not None and self.prompt is None:
            raise ValueError("suffix needs a prompt as text: insert mode fills in between "
                             "the prompt and the suffix")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages: the model's chat template renders them")
        if self.messages is None and (self.chat_template_kwargs is not None
                                      or self.continue_final_message
                                      or not self.add_generation_prompt):
            raise ValueError("chat_template_kwargs, add_generation_prompt and "
                             "continue_final_message need messages: they shape the chat "
                             "template's rendering")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message goes with add_generation_prompt false: "
                             "the last message is continued, no new one opened")
        if self.continue_final_message and self.messages and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the "
                             "assistant's: it is the one continued")
        chars = (len(self.prompt or "") + len(self.suffix or "")
                 + sum(len(m.content) + len(m.name or "") for m in self.messages or []))
        if chars > limits.max_prompt_chars:
            raise ValueError(
                f"prompt is {chars} characters, above this fleet's limit of "
                f"{limits.max_prompt_chars} (TOKENFLEET_MAX_PROMPT_CHARS)"
            )
        meta_bytes = len(orjson.dumps(self.metadata))  # JSON-safe: checked above
        if meta_bytes > limits.max_metadata_bytes:
            raise ValueError(
                f"metadata is {meta_bytes} bytes as JSON, above the limit of "
                f"{limits.max_metadata_bytes} (TOKENFLEET_MAX_METADATA_BYTES)"
            )
        payload = len(self.model_dump_json())
        if payload > limits.max_payload_bytes:
            raise ValueError(
                f"request is {payload} bytes as JSON, above the limit of "
                f"{limits.max_payload_bytes} (TOKENFLEET_MAX_PAYLOAD_BYTES)"
            )
        return self

    def fingerprint(self) -> str:
        """What the request asks for, as a digest: the same for a retry of it, different
        for any other request. Stored with an idempotency key, so that the key
        coming back with another request is refused rather than answered with
        someone else's job (and with it read and cancel access)."""
        asked = self.model_dump(mode="json", exclude={"idempotency_key"})
        return hashlib.sha256(orjson.dumps(asked, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def json_problem(value: Any, where: str) -> str | None:
    """What keeps ``value`` from being plain JSON (named by its path), or None.

    orjson writes NaN as null and raises a bare TypeError on sets, bytes and
    other objects; this names the first offending value by its path instead
    (iteratively: deep nesting cannot hit the recursion limit). Tuples pass:
    they are written as arrays.
    """
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            return f"{path} nests more than {MAX_METADATA_DEPTH} levels deep"
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, int):
            if not -(2**63) <= item < 2**64:
                return f"{path} is an integer outside the 64-bit range"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{path} is {item}, not a finite number"
        elif isinstance(item, str):
            if not _utf8(item):
                return f"{path} is a string that is not valid UTF-8 (a lone surrogate)"
        elif isinstance(item, dict):
            for key, sub in item.items():
                if not isinstance(key, str) or not _utf8(key):
                    return f"{path} has a key {key!r} that is not a string"
                stack.append((sub, f"{path}[{key!r}]", depth + 1))
        elif isinstance(item, list | tuple):
            stack.extend((sub, f"{path}[{i}]", depth + 1) for i, sub in enumerate(item))
        else:
            return f"{path} is of type {type(item).__name__}, which JSON cannot hold"
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class JobStatus(str, enum.Enum):
    """Ordered like a job's life: everything after RUNNING is final."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    ERROR = "error"
    DEADLINE = "deadline"


# The error of a job whose deadline passed while it was queued: what a worker
# stores when it reads the job, what repair stores, and what a reader reports
# before either has written it.
EXPIRED_ERROR = "deadline passed before the job started"

# How the error of a job its worker refused begins (a prompt over the worker's
# token limit, a value over its own limits): the request's fault, not the fleet's,
# so the gateway answers it with a 400 that no client retries, not a 500.
REFUSED_BY_WORKER = "refused by the worker: "


# Hash fields of the job record that hold JSON rather than a plain string.
JSON_FIELDS = ("token_ids", "metadata", "request")


class JobState(BaseModel):
    """The stored record of one job, as ``status`` returns it."""

    model_config = ConfigDict(extra="ignore")

    id: str
    status: JobStatus
    model: str = "default"
    priority: Priority = "normal"
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    attempts: int = 0
    worker: str | None = None
    num_prompt_tokens: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    tenant: str | None = None  # None: the tenant "default"
    created_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    deadline_at: float | None = None

    @classmethod
    def from_redis(cls, fields: dict[str, str]) -> JobState:
        """Parse a job hash as HGETALL returns it (decoded strings)."""
        data: dict[str, Any] = {k: v for k, v in fields.items() if v != ""}
        for name in JSON_FIELDS:
            if name in data:
                data[name] = orjson.loads(data[name])
        return cls.model_validate(data)


class TopLogprob(BaseModel):
    """One of the likeliest tokens at a position, with its log probability."""

    token_id: int
    token: str  # the token decoded alone
    logprob: float

    @model_validator(mode="before")
    @classmethod
    def _from_wire(cls, value: Any) -> Any:
        # The token log holds [token_id, token, logprob]: compact, a few per token.
        return _positional(value, ("token_id", "token", "logprob"))


class TokenLogprob(BaseModel):
    """A generated token's log probability under the model's own distribution
    (the raw logits, before temperature, penalties or bias: as vLLM reports them
    by default), and the ``SamplingParams.logprobs`` likeliest tokens there."""

    token: str  # the token decoded alone (its share of the text may differ)
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _from_wire(cls, value: Any) -> Any:
        # The token log holds [token, logprob, [top, ...]].
        return _positional(value, ("token", "logprob", "top"))


class PromptToken(BaseModel):
    """A prompt token's log probability after the tokens before it (None for
    the first, as OpenAI and vLLM write it), and the likeliest tokens there."""

    token: str  # the token decoded alone
    logprob: float | None = None
    top: list[TopLogprob] | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_wire(cls, value: Any) -> Any:
        # The token log holds [token, logprob, [top, ...]] ([token, null, null] first).
        return _positional(value, ("token", "logprob", "top"))


class PromptEcho(BaseModel):
    """The prompt as the worker read it, on a job's first event when the job
    asked for its prompt's log probabilities (``SamplingParams.prompt_logprobs``):
    its text (decoded: a prompt of token ids has none of its own) and one
    ``PromptToken`` per prompt token."""

    text: str
    token_ids: list[int]
    tokens: list[PromptToken]
    offsets: list[int]  # where each token starts in ``text``


def _positional(value: Any, names: tuple[str, ...]) -> Any:
    """A model's fields given as a list in ``names``' order, as a dict (else as is)."""
    if isinstance(value, list | tuple) and len(value) == len(names):
        return dict(zip(names, value))
    return value


class TokenEvent(BaseModel):
    """Tokens a job produced, in order: ``index`` is the position of the first one.

    An event carries one token or several: a worker sends the tokens a job made
    within a short window (``coalesce_ms``, up to ``coalesce_tokens``) as one
    event; a job's first token comes alone, at once. Events of a stream are
    contiguous: each starts at the ``end`` of the one before.

    ``token_ids`` are the event's tokens; ``text`` is what they add to the job's
    text together; it may be empty while a token ends inside a UTF-8 sequence
    (held back until it decodes cleanly). ``offsets``, on an event of several
    tokens, says where the text of each token ends in ``text`` (characters), so
    the event can be cut at any token (``after``).

    ``logprobs``, for a job that asked for them (``SamplingParams.logprobs``),
    has one ``TokenLogprob`` per token id; None otherwise.
    """

    index: int
    token_ids: list[int]
    text: str
    offsets: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt: PromptEcho | None = None  # on the first event (index 0), when asked for
    # On the first event (index 0): the prompt's length in the model's tokens, so
    # a stream can count usage as it goes (a worker before this field: None).
    prompt_tokens: int | None = None

    @property
    def end(self) -> int:
        """The index after the event's last token (where the next event starts)."""
        return self.index + len(self.token_ids)

    def after(self, index: int) -> TokenEvent:
        """The event less its tokens before ``index``, for a consumer that has them
        already (an event that starts at or after ``index`` is returned as is)."""
        skip = index - self.index
        if skip <= 0:
            return self
        cut = self.offsets[skip - 1] if self.offsets else len(self.text)
        rest = self.offsets[skip:] if self.offsets else None
        return TokenEvent(index=index, token_ids=self.token_ids[skip:], text=self.text[cut:],
                          offsets=[o - cut for o in rest] if rest and len(rest) > 1 else None,
                          logprobs=self.logprobs[skip:] if self.logprobs is not None else None)

    def token_texts(self) -> list[str]:
        """What each token adds to the text (from ``offsets``)."""
        if len(self.token_ids) == 1:
            return [self.text]
        ends = self.offsets or [len(self.text)] * len(self.token_ids)
        return [self.text[start:end] for start, end in zip([0, *ends], ends)]


class EndEvent(BaseModel):
    """The last event of a job: its final status."""

    status: JobStatus
    finish_reason: FinishReason | None = None
    error: str | None = None


class Limit(BaseModel):
    """One limit of a queue, and what sets it, as a refusal names it: ``by``
    the model, the queue (its workers' settings) or this client; ``why`` the
    model's length or the setting's variable."""

    model_config = ConfigDict(extra="ignore")

    value: int
    by: str
    why: str


class QueueLimits(BaseModel):
    """The limits one side holds a queue's requests to: what a worker's model
    and settings allow (published with its heartbeat), or a client's own
    settings. ``submit.lua`` holds a request to the strictest of all."""

    model_config = ConfigDict(extra="ignore")

    prompt_tokens: Limit  # the prompt, in tokens of the model's tokenizer
    new_tokens: Limit  # max_new_tokens
    payload_bytes: Limit  # the request as JSON
    queue: Limit  # jobs waiting or running in the queue, every level counted


class QueueEntry(BaseModel):
    """What a stream entry carries: the job id and the request it runs."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1, max_length=128)  # "<queue (64)>:<32 hex>"
    request: GenerationRequest
    created_at: float
    deadline_at: float | None = None
    # Its prompt's prefix keys (shared/wire/prefixes.py), shortest first, with
    # placement on: the worker that starts it advertises them as held.
    prefixes: list[str] = Field(default_factory=list, max_length=16)


def queue_entry(fields: dict[bytes, bytes]) -> QueueEntry | None:
    """The entry a queue stream's entry carries (its fields as read), or None for
    one no job comes from: the reader that takes it dead-letters it, and
    everything else that looks at the stream passes it over."""
    try:
        return QueueEntry.model_validate_json(fields[b"data"])
    except (KeyError, ValueError):  # a pydantic ValidationError is a ValueError
        return None


class ApiKey(BaseModel):
    """One gateway API key as stored: its tenant and limits, never the key
    itself (its record is found by the key's SHA-256). A limit left None is no
    limit."""

    model_config = ConfigDict(extra="ignore")

    key_id: str  # public: what ``keys list`` shows and ``keys revoke`` takes
    tenant: str
    rpm: int | None = Field(default=None, ge=1)  # requests per minute
    tpm: int | None = Field(default=None, ge=1)  # tokens per minute (prompt + max new)
    queues: list[str] | None = None  # the queues (models) it may use; None: every one
    max_queued: int | None = Field(default=None, ge=1)  # the tenant's jobs waiting or running
    # The highest priority its requests may ask (fair share holds within a level
    # only: a level above is ahead of every tenant's normal work).
    max_priority: Literal["high", "normal", "low"] = "normal"
    # Sees every tenant in the console (``/console``); its own requests are its
    # tenant's as any key's are.
    admin: bool = False
    created_at: float

    @property
    def limited(self) -> bool:
        """Whether requests made with it are counted (it has a rate limit)."""
        return self.rpm is not None or self.tpm is not None
