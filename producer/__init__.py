"""tokenfleet: an LLM inference fleet behind Redis Streams.

This package is the client a web backend imports (it needs only redis and
pydantic): submit jobs, read their state, stream their tokens. The worker side
lives in ``tokenfleet.workers`` and needs the ``worker`` extra (torch, Celery).

    from tokenfleet import FleetClient
    client = FleetClient("redis://127.0.0.1:6379/0")
    job_id = client.submit("Once upon a time", max_new_tokens=32)
"""

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.client.batch_records import Batch
from tokenfleet.client.sync import FleetClient
from tokenfleet.client.generation import AsyncGeneration, Generation
from tokenfleet.shared.wire.errors import (
    IdempotencyConflict,
    InvalidRequest,
    JobNotFound,
    LimitExceeded,
    NoWorker,
    OverTokenRate,
    PromptTooLong,
    QueueFull,
    PriorityNotAllowed,
    QueueNotAllowed,
    RateLimited,
    RedisAuthFailed,
    RedisBusy,
    RedisUnavailable,
    TenantQueueFull,
    TokenfleetError,
    TokenRateLimited,
    WorkersGone,
)
from tokenfleet.shared.wire.schemas import (
    ChatMessage,
    EndEvent,
    FinishReason,
    GenerationRequest,
    JobState,
    JobStatus,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
)

__all__ = [
    "AsyncFleetClient",
    "AsyncGeneration",
    "Batch",
    "ChatMessage",
    "EndEvent",
    "FinishReason",
    "FleetClient",
    "Generation",
    "GenerationRequest",
    "IdempotencyConflict",
    "InvalidRequest",
    "JobNotFound",
    "JobState",
    "JobStatus",
    "LimitExceeded",
    "NoWorker",
    "OverTokenRate",
    "PriorityNotAllowed",
    "PromptTooLong",
    "QueueFull",
    "QueueNotAllowed",
    "RateLimited",
    "RedisAuthFailed",
    "RedisBusy",
    "RedisUnavailable",
    "SamplingParams",
    "TenantQueueFull",
    "TokenEvent",
    "TokenLogprob",
    "TokenRateLimited",
    "TokenfleetError",
    "TopLogprob",
    "WorkersGone",
]
