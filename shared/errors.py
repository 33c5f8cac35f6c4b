"""Errors a producer can act on."""

from __future__ import annotations


class TokenfleetError(Exception):
    """Base of the fleet's own errors."""


class QueueFull(TokenfleetError):
    """The model's queue holds ``max_queue`` jobs; nothing was enqueued. Retry later."""

    def __init__(self, queue: str, depth: int, limit: int) -> None:
        super().__init__(
            f"queue {queue!r} is full ({depth} jobs waiting or running, limit {limit}); "
            "nothing was enqueued: retry later or raise TOKENFLEET_MAX_QUEUE"
        )
        self.queue, self.depth, self.limit = queue, depth, limit


class JobNotFound(TokenfleetError):
    """No record for this job id: never submitted, or expired after its result TTL."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r}: never submitted, or its record expired")
        self.job_id = job_id


class NoWorker(TokenfleetError):
    """``require_worker=True`` and no live worker serves the queue."""

    def __init__(self, queue: str) -> None:
        super().__init__(f"no live worker serves queue {queue!r}; start one with "
                         f"`tokenfleet worker --queue {queue}`")
        self.queue = queue
