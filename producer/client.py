"""The blocking client, for scripts and synchronous web backends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from tokenfleet.protocol import (
    EventCursor,
    build_request,
    check_deadline,
    cancel_args,
    cancelled,
    is_end,
    live_worker_args,
    parse_state,
    submission,
    submitted_id,
    time_slice,
)
from tokenfleet.shared.errors import JobNotFound, NoWorker
from tokenfleet.shared.keys import Keys
from tokenfleet.shared.redis_conn import connect
from tokenfleet.shared.schemas import GenerationRequest, JobState, TokenEvent
from tokenfleet.shared.scripts import Scripts
from tokenfleet.shared.settings import Settings, get_settings


class FleetClient:
    """Submit jobs to the fleet and follow them.

    ``FleetClient()`` reads ``TOKENFLEET_REDIS_URL``; pass a URL to override it.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        namespace: str | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings or get_settings()
        # redis-py types replies as bytes | str; with decode_responses off they are bytes.
        self.redis: Any = connect(url or self.settings.redis_url)
        self.keys = Keys(namespace or self.settings.namespace)
        self._scripts = Scripts(self.redis)

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.redis.close()

    def submit(self, prompt: str | GenerationRequest | None = None, /, *,
               require_worker: bool = False, **kwargs: Any) -> str:
        """Validate, then enqueue atomically; returns the job id.

        Keyword arguments are the fields of ``SamplingParams`` and of
        ``GenerationRequest``. Raises ``pydantic.ValidationError`` for bad input
        (nothing is written), ``QueueFull`` when the model's queue is full, and
        with ``require_worker=True`` ``NoWorker`` when no live worker serves it.
        """
        request = build_request(prompt, kwargs, self.settings)
        if require_worker:
            key, since = live_worker_args(request.model, self.keys)
            if not self.redis.zcount(key, since, "+inf"):
                raise NoWorker(request.model)
        sub = submission(request, self.keys, self.settings)
        result = self._scripts.submit(keys=sub.keys, args=sub.args)
        return submitted_id(result, request.model, self.settings)

    def status(self, job_id: str) -> JobState:
        """The job's stored state, read once; never blocks."""
        return parse_state(job_id, self.redis.hgetall(self.keys.job(job_id)))

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job; False if it had already ended."""
        # The queue's key goes to the script with the others (declared keys only).
        model, priority = self.redis.hmget(self.keys.job(job_id), ["model", "priority"])
        if model is None:
            raise JobNotFound(job_id)
        keys, args = cancel_args(job_id, model.decode(), (priority or b"normal").decode(),
                                 self.keys, self.settings)
        return cancelled(self._scripts.cancel(keys=keys, args=args), job_id)

    def wait(self, job_id: str, timeout: float | None = None) -> JobState:
        """Block until the job ends; ``TimeoutError`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.redis.pubsub() as pubsub:
            _subscribe(pubsub, self.keys.events(job_id))
            while True:
                state = self.status(job_id)
                if state.status.is_terminal:
                    return state
                # Token messages do not change the status: listen on until the
                # end message or a quiet interval, then read the record again.
                while True:
                    message = pubsub.get_message(timeout=time_slice(deadline))
                    if message is None or is_end(message):
                        break
                check_deadline(deadline, job_id)

    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Yield the job's token events in order, from its first token to its end.

        Works whenever it starts: what was generated before is replayed from the
        job's token log, the rest arrives live, with no gap and no duplicate.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        cursor = EventCursor()
        with self.redis.pubsub() as pubsub:
            _subscribe(pubsub, self.keys.events(job_id))
            self._catch_up(job_id, cursor)
            yield from cursor.take()
            while not cursor.ended:
                message = pubsub.get_message(timeout=time_slice(deadline))
                if not cursor.feed_message(message):
                    self._catch_up(job_id, cursor)
                yield from cursor.take()
                if not cursor.ended:
                    check_deadline(deadline, job_id)

    def _catch_up(self, job_id: str, cursor: EventCursor) -> None:
        """Read the token log past the cursor; end it if the record says so."""
        cursor.feed_log(self.redis.xrange(self.keys.out(job_id), cursor.log_after(), "+"))
        if cursor.ended:
            return
        state = self.status(job_id)  # raises JobNotFound
        if state.status.is_terminal:
            # Ended between the two reads: the log now holds every token.
            cursor.feed_log(self.redis.xrange(self.keys.out(job_id), cursor.log_after(), "+"))
            cursor.ended = True


def _subscribe(pubsub: Any, channel: str) -> None:
    pubsub.subscribe(channel)
    # Wait for the confirmation: only then is every later publish seen, so a read
    # of the log after this point cannot miss a token published in between.
    while True:
        message = pubsub.get_message(ignore_subscribe_messages=False, timeout=5.0)
        if message is not None and message["type"] == "subscribe":
            return
        if message is None:
            raise TimeoutError(f"no confirmation of the subscription to {channel}")
