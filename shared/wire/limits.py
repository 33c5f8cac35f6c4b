"""The limits a queue holds requests to: the fleet's own, and a client's.

Each worker publishes what its model and its settings allow with every
heartbeat (``worker_limits``, in ``<ns>:limits:{<queue>}``); ``submit.lua``
holds a request to the strictest of those of the queue's workers and of the
submitting client's settings (``client_limits``). A limit set on the workers
therefore holds whoever submits, and a client's own setting can only make it
stricter. While no worker has published (none live) the client's settings hold
alone. The worker checks its own limits again when it takes a job.
"""

from __future__ import annotations

from tokenfleet.shared.wire.schemas import Limit, QueueLimits
from tokenfleet.shared.settings import Settings

# Who sets a limit, as a refusal names it.
BY_MODEL, BY_QUEUE, BY_CLIENT = "the model", "the queue", "this client"


def worker_limits(settings: Settings, max_model_len: int) -> QueueLimits:
    """What a worker running a model of ``max_model_len`` tokens (prompt and
    output; as its engine reports it) allows, its settings applied."""
    def setting(value: int, variable: str) -> Limit:
        return Limit(value=value, by=BY_QUEUE, why=f"{variable} of the queue's workers")

    # The model needs room for at least one new token after the prompt.
    model_allows = max_model_len - 1
    prompt = (Limit(value=model_allows, by=BY_MODEL, why=f"model length {max_model_len}")
              if model_allows <= settings.max_prompt_tokens
              else setting(settings.max_prompt_tokens, "TOKENFLEET_MAX_PROMPT_TOKENS"))
    return QueueLimits(
        prompt_tokens=prompt,
        new_tokens=setting(settings.max_new_tokens_limit, "TOKENFLEET_MAX_NEW_TOKENS_LIMIT"),
        payload_bytes=setting(settings.max_payload_bytes, "TOKENFLEET_MAX_PAYLOAD_BYTES"),
        queue=setting(settings.max_queue, "TOKENFLEET_MAX_QUEUE"),
    )


def client_limits(settings: Settings) -> QueueLimits:
    """What a client's own settings allow."""
    def setting(value: int, variable: str) -> Limit:
        return Limit(value=value, by=BY_CLIENT, why=f"{variable} of this client")

    return QueueLimits(
        prompt_tokens=setting(settings.max_prompt_tokens, "TOKENFLEET_MAX_PROMPT_TOKENS"),
        new_tokens=setting(settings.max_new_tokens_limit, "TOKENFLEET_MAX_NEW_TOKENS_LIMIT"),
        payload_bytes=setting(settings.max_payload_bytes, "TOKENFLEET_MAX_PAYLOAD_BYTES"),
        queue=setting(settings.max_queue, "TOKENFLEET_MAX_QUEUE"),
    )
