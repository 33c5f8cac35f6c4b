"""A job's tokens as Server-Sent Events: the frames of ``GET /v1/jobs/{id}/events``,
and of the console's job page, which streams the same events to a browser."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.gateway import sse
from tokenfleet.gateway.metrics import first_token


async def job_event_frames(client: AsyncFleetClient, job_id: str, after: int, scope: Any
                           ) -> AsyncIterator[bytes]:
    """``event: token`` per token event after the token of index ``after`` (``id:``
    the index of its last token), then ``event: end`` with the final job state."""
    async with contextlib.aclosing(client.stream_batches(job_id)) as batches:
        async for events in batches:
            # A backlog goes out as one write: the same events, fewer frames.
            frame = b"".join(sse.event(e.after(after + 1).model_dump_json(exclude_none=True),
                                       name="token", event_id=e.end - 1)
                             for e in events if e.end > after + 1)
            if frame:
                first_token(scope)
                yield frame
    yield sse.event((await client.status(job_id)).model_dump_json(), name="end")
