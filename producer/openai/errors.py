"""Every way the gateway refuses a request, as OpenAI's clients read it: the HTTP
status, OpenAI's error ``type`` and ``code``, whether a retry can help, and the
sentence (``<...>`` stands for what each request fills in).

The status decides what a client does next: OpenAI's clients retry 408, 409, 429
and every 5xx on their own, and honour an ``x-should-retry`` header over that.
So a request that can never succeed is a 4xx that is not retried (an over-long
prompt is 400, an unknown model 404), and only what a retry can fix asks for
one (a full queue: 429 with ``Retry-After``; Redis out of reach: 503).

``docs/errors.md`` shows :data:`REFUSALS` as a table; ``tests/test_refusals.py``
reads both and checks that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INVALID = "invalid_request_error"
SERVER = "server_error"

# What a 429 or 503 asks a client to wait: queues drain at the fleet's pace, and
# a client that retries at once only adds load.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class OpenAIError:
    """A refused request as OpenAI's clients read it, with no HTTP object in it:
    the gateway answers it (``gateway.error_response``), a batch line stores its
    status and body as the line's response."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]

    @property
    def message(self) -> str:
        return str(self.body["error"]["message"])

    @property
    def code(self) -> str:
        """OpenAI's ``code``, else its ``type``: what a batch line's error names."""
        error = self.body["error"]
        return str(error.get("code") or error.get("type"))


@dataclass(frozen=True)
class Refusal:
    status: int
    type: str
    code: str | None
    retry: bool  # whether a client should try the same request again
    when: str  # what the request did or met, as the docs say it
    sentence: str  # the message's pattern, as the docs show it

    def error(self, message: str, *, param: str | None = None,
              headers: dict[str, str] | None = None) -> OpenAIError:
        """The error in OpenAI's shape; ``message`` is :attr:`sentence` filled in."""
        return OpenAIError(self.status, self.body(message, param=param),
                           {**self.headers(), **(headers or {})})

    def body(self, message: str, *, param: str | None = None) -> dict[str, Any]:
        """The response's JSON body (a batch line's refused request carries it too)."""
        return {"error": {"message": message, "type": self.type, "param": param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Tell clients whether to retry, whatever their default for the status is."""
        out = {"x-should-retry": "true" if self.retry else "false"}
        if self.retry and self.status in (429, 503):
            out["Retry-After"] = str(RETRY_AFTER_S)
        return out


INVALID_JSON = Refusal(
    400, INVALID, None, False, "the body is not JSON",
    "not valid JSON (<what the parser found>)")
UNRECOGNIZED = Refusal(
    400, INVALID, None, False, "a field OpenAI's API does not have",
    "unrecognized request argument '<field>'")
INVALID_VALUE = Refusal(
    400, INVALID, None, False, "a value of the wrong type (true for a number) or past a limit",
    "invalid '<field>': <what is wrong with it, and the limit>")
UNSUPPORTED = Refusal(
    400, INVALID, "unsupported_parameter", False,
    "a field this gateway cannot honour, set to more than nothing",
    "<field> is not supported by this gateway: <what to send instead>")
CONTEXT_LENGTH = Refusal(
    400, INVALID, "context_length_exceeded", False,
    "the prompt (a chat: its messages' text) has more tokens than the queue allows",
    "prompt has <n> tokens; <the model, the queue's workers or this gateway> allows <limit> "
    "(<what sets it: model length <n>, or the setting>)")
OVER_LIMIT = Refusal(
    400, INVALID, None, False,
    "a request over a limit the queue's workers publish (max_new_tokens, size)",
    "<what the request asks> is <n>; <the queue's workers or this gateway> allows <limit> "
    "(<the setting>)")
NO_CHAT_TEMPLATE = Refusal(
    400, INVALID, "chat_template_missing", False,
    "a chat for a model whose tokenizer has no chat template",
    "model '<model>' has no chat template (its tokenizer defines none), so it cannot take "
    "messages: send a prompt to /v1/completions instead, or serve a model with a chat template")
MODEL_NOT_FOUND = Refusal(
    404, INVALID, "model_not_found", False, "no live worker serves the model's queue",
    "the model '<model>' does not exist or no live worker serves it (served now: <models>): "
    "GET /v1/models lists those served")
JOB_NOT_FOUND = Refusal(
    404, INVALID, "not_found", False, "no such job (the jobs API)",
    "no job '<id>': never submitted, or its record expired")
BATCH_NOT_FOUND = Refusal(
    404, INVALID, "not_found", False,
    "no such batch, or a batch's input file that does not exist (the batches API)",
    "no batch '<id>' (or: no file '<id>'): never made, or another tenant's")
RESPONSE_NOT_FOUND = Refusal(
    404, INVALID, "not_found", False,
    "no such stored response, or another tenant's (the Responses API; previous_response_id too)",
    "no response '<id>': never made, not stored, deleted or expired")
FILE_NOT_FOUND = Refusal(
    404, INVALID, None, False, "no such file, or another tenant's (the files API)",
    "no file '<id>': never uploaded, or deleted")
UNKNOWN_URL = Refusal(
    404, INVALID, "unknown_url", False,
    "a path no route of the gateway serves (/v1/embeddings, /v1/moderations, /v1/audio/...)",
    "Invalid URL (<method> <path>): this gateway does not serve it (it serves /v1/completions, "
    "/v1/chat/completions, /v1/responses, /v1/models, /v1/files, /v1/batches and /v1/jobs)")
METHOD_NOT_ALLOWED = Refusal(
    405, INVALID, "method_not_allowed", False,
    "a path the gateway serves, with another method (its Allow header lists them)",
    "Invalid method (<method> <path>): this gateway does not serve <method> on <path> "
    "(allowed: <methods>)")
BODY_TIMEOUT = Refusal(
    408, INVALID, "request_timeout", True, "the body did not arrive in time",
    "the request body did not arrive within this gateway's limit of <s> s "
    "(TOKENFLEET_BODY_TIMEOUT_S): send it at once, or raise the limit")
IDEMPOTENCY_CONFLICT = Refusal(
    409, INVALID, "idempotency_conflict", False,
    "an idempotency key reused for another request (the jobs API)",
    "idempotency key '<key>' was already used for a different request (another model, prompt "
    "or parameters); nothing was enqueued: use a new key for a new request")
TOO_LARGE = Refusal(
    413, INVALID, "request_too_large", False, "the body is over the payload limit",
    "request body is larger than this gateway's limit of <n> bytes "
    "(TOKENFLEET_MAX_PAYLOAD_BYTES): send a shorter prompt or raise the limit")
INVALID_API_KEY = Refusal(
    401, INVALID, "invalid_api_key", False,
    "no API key, or one that does not exist (revoked) on a gateway with keys",
    "missing API key: send 'Authorization: Bearer <key>' (tokenfleet keys create makes one); "
    "or: incorrect API key provided")
QUEUE_NOT_ALLOWED = Refusal(
    403, "permission_error", "model_not_allowed", False,
    "a model (queue) the API key may not use (its --queues)",
    "this API key may not use the model '<model>' (its queues: <queues>); nothing was enqueued")
PRIORITY_NOT_ALLOWED = Refusal(
    403, "permission_error", "priority_not_allowed", False,
    "a priority above the API key's --max-priority",
    "this API key may not send priority '<priority>' (its max priority: '<max>', `tokenfleet "
    "keys create --max-priority`); send '<max>' or lower; nothing was enqueued")
RATE_LIMITED = Refusal(
    429, "requests", "rate_limit_exceeded", True,
    "the API key used its requests per minute (rpm)",
    "rate limit reached for requests: <n> in the last minute, limit <rpm> (rpm); retry after "
    "<s> s (Retry-After)")
TOKEN_RATE_LIMITED = Refusal(
    429, "tokens", "rate_limit_exceeded", True,
    "the API key used its tokens per minute (tpm: prompt and max_tokens of each request)",
    "rate limit reached for tokens: <n> used in the last minute, this request <m>, limit <tpm> "
    "(tpm); retry after <s> s (Retry-After)")
OVER_TOKEN_RATE = Refusal(
    429, "tokens", "rate_limit_exceeded", False,
    "one request counts more tokens than the key's tpm: it can never pass",
    "this request counts <n> tokens (its prompt and max_tokens), more than the API key's "
    "limit of <tpm> tokens per minute (tpm): lower max_tokens or the prompt")
TENANT_QUEUE_FULL = Refusal(
    429, "requests", "rate_limit_exceeded", True,
    "the tenant has its key's max_queued jobs waiting or running",
    "tenant '<tenant>' has <n> jobs waiting or running, the API key's limit (max_queued <n>); "
    "nothing was enqueued: retry when some have ended")
QUEUE_FULL = Refusal(
    429, "requests", "rate_limit_exceeded", True, "the model's queue is full",
    "queue '<model>' is full (<n> jobs waiting or running, limit <limit>); nothing was "
    "enqueued: retry later or raise TOKENFLEET_MAX_QUEUE")
JOB_REFUSED = Refusal(
    400, INVALID, None, False,
    "the queue's worker refused the job (a limit only it knows, such as the prompt's tokens "
    "with the chat template)",
    "the job ended failed (refused by the worker: <its reason>); the completion has no result")
JOB_FAILED = Refusal(
    500, SERVER, None, False, "the job failed on its worker, which retried it already",
    "the job ended <status> (<reason>); the completion has no result")
REDIS_REFUSED = Refusal(
    500, SERVER, None, False, "Redis refused the gateway's credentials",
    "the fleet's Redis refused this gateway's credentials: the operator must fix "
    "TOKENFLEET_REDIS_URL")
REDIS_DOWN = Refusal(
    503, SERVER, None, True, "Redis cannot be reached (from the gateway's first request on)",
    "the fleet's Redis cannot be reached right now; retry later")
MODEL_UNAVAILABLE = Refusal(
    503, SERVER, "model_unavailable", True,
    "the model's queue was served, but no worker has been live for longer than the grace "
    "period (TOKENFLEET_NO_WORKER_GRACE_S; within it, requests queue)",
    "no live worker has served queue '<model>' for <s> s, past the grace period of <s> s "
    "(TOKENFLEET_NO_WORKER_GRACE_S) in which its jobs wait for its workers to come back; "
    "nothing was enqueued: retry later")
REDIS_BUSY = Refusal(
    503, SERVER, "busy", True,
    "every Redis connection of the gateway stayed in use for the whole wait",
    "the fleet is busy: all <n> Redis connections of this gateway stayed in use for <s> s; "
    "retry later, or raise TOKENFLEET_GATEWAY_REDIS_CONNECTIONS")

# In the order the docs list them.
REFUSALS = (INVALID_JSON, UNRECOGNIZED, INVALID_VALUE, UNSUPPORTED, CONTEXT_LENGTH, OVER_LIMIT,
            NO_CHAT_TEMPLATE, INVALID_API_KEY, QUEUE_NOT_ALLOWED, PRIORITY_NOT_ALLOWED,
            MODEL_NOT_FOUND, JOB_NOT_FOUND,
            BATCH_NOT_FOUND, RESPONSE_NOT_FOUND, FILE_NOT_FOUND, UNKNOWN_URL, METHOD_NOT_ALLOWED,
            BODY_TIMEOUT, IDEMPOTENCY_CONFLICT, TOO_LARGE, RATE_LIMITED, TOKEN_RATE_LIMITED,
            OVER_TOKEN_RATE, TENANT_QUEUE_FULL, QUEUE_FULL, JOB_REFUSED, JOB_FAILED,
            REDIS_REFUSED, REDIS_DOWN, MODEL_UNAVAILABLE, REDIS_BUSY)

# The fleet's own errors, by class name: an error class that a newer client adds
# maps the same whether or not this module could import it.
FLEET_ERRORS = {"QueueFull": QUEUE_FULL, "NoWorker": MODEL_NOT_FOUND,
                "IdempotencyConflict": IDEMPOTENCY_CONFLICT, "JobNotFound": JOB_NOT_FOUND,
                "PromptTooLong": CONTEXT_LENGTH, "LimitExceeded": OVER_LIMIT,
                "InvalidRequest": INVALID_VALUE, "RedisBusy": REDIS_BUSY,
                "RedisUnavailable": REDIS_DOWN, "RedisAuthFailed": REDIS_REFUSED,
                "QueueNotAllowed": QUEUE_NOT_ALLOWED, "PriorityNotAllowed": PRIORITY_NOT_ALLOWED,
                "RateLimited": RATE_LIMITED,
                "TokenRateLimited": TOKEN_RATE_LIMITED, "OverTokenRate": OVER_TOKEN_RATE,
                "TenantQueueFull": TENANT_QUEUE_FULL, "WorkersGone": MODEL_UNAVAILABLE}


def fleet_refusal(exc: Exception, path: str) -> tuple[Refusal, str, str | None]:
    """The row, message and ``param`` of the fleet's error ``exc`` met by a
    request to ``path`` (a 5xx says its sentence: no Redis URL reaches callers)."""
    name = type(exc).__name__
    refusal = FLEET_ERRORS.get(name, INVALID_VALUE)
    # A 5xx says its sentence (no Redis URL reaches callers); the one a
    # caller acts on by waiting says the model and for how long.
    message = (refusal.sentence if refusal.status >= 500 and refusal is not MODEL_UNAVAILABLE
               else str(exc))
    param = None
    if name == "PromptTooLong":
        param = {"/v1/chat/completions": "messages", "/v1/responses": "input"}.get(path, "prompt")
    elif name in ("QueueNotAllowed", "WorkersGone"):
        param = "model"
    elif name == "PriorityNotAllowed":
        param = "priority"
    elif name == "InvalidRequest" and any(
            e.get("loc") == ["webhook_url"] for e in getattr(exc, "errors", None) or []):
        param = "webhook_url"  # a destination submit refused (webhook_destination)
    return refusal, message, param
